// A small, safe Markdown renderer and code highlighter for model output.
//
// Safety: every piece of the source reaches the HTML escaped (escapeHtml), and only the tags this file
// writes itself are ever produced; links keep only http(s) and mailto URLs. Model output is never
// injected as HTML. Covers what chat models write: paragraphs, headings, fenced code (highlighted),
// lists (nested by indentation), block quotes, tables, rules, and inline code, bold, italic,
// strikethrough and links.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// --- highlighting ---------------------------------------------------------------------------------

const KEYWORDS = new Set(
  (
    "if else elif for while do return break continue switch case default try catch except finally throw " +
    "throws raise new delete class struct enum union interface trait impl type typedef import from export " +
    "as in of is not and or def fn func function lambda with yield async await const let var mut static " +
    "public private protected extends implements package module mod use pub crate self this super true " +
    "false null nil none None True False undefined void int float double char bool boolean long short " +
    "unsigned signed auto string str match loop where go defer chan map range select pass global " +
    "nonlocal del assert then fi done esac local echo begin end elsif unless until"
  ).split(" "),
);
const HASH_COMMENTS = new Set([
  "python", "py", "bash", "sh", "shell", "zsh", "console", "ruby", "rb", "yaml", "yml", "toml", "r",
  "perl", "pl", "dockerfile", "makefile", "make", "ini", "conf", "nix", "elixir", "julia", "powershell",
]);
const DASH_COMMENTS = new Set(["sql", "lua", "haskell", "hs"]);
const PLAIN = new Set(["text", "txt", "plain", "plaintext", "markdown", "md", "output", "log"]);

/** `code` as HTML with <span class="tok-*"> around keywords, strings, numbers, comments, calls. */
export function highlight(code, lang = "") {
  const language = String(lang).toLowerCase();
  if (PLAIN.has(language)) return escapeHtml(code);
  const comments = [];
  if (HASH_COMMENTS.has(language)) comments.push("#[^\\n]*");
  else comments.push("\\/\\/[^\\n]*", "\\/\\*[\\s\\S]*?(?:\\*\\/|$)");
  if (DASH_COMMENTS.has(language)) comments.push("--[^\\n]*");
  const token = new RegExp(
    `(${comments.join("|")})` +
      "|(\"\"\"[\\s\\S]*?(?:\"\"\"|$)|\"(?:[^\"\\\\\\n]|\\\\.)*\"?|'(?:[^'\\\\\\n]|\\\\.)*'?|`(?:[^`\\\\]|\\\\.)*`?)" +
      "|(\\b(?:0[xX][0-9a-fA-F_]+|\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?)\\b)" +
      "|([A-Za-z_$][\\w$]*)(?=(\\s*\\()?)",
    "g",
  );
  let html = "";
  let last = 0;
  for (const match of code.matchAll(token)) {
    html += escapeHtml(code.slice(last, match.index));
    const [text, comment, string, number, word, call] = match;
    let kind = "";
    if (comment) kind = "com";
    else if (string) kind = "str";
    else if (number) kind = "num";
    else if (word && KEYWORDS.has(word)) kind = "kw";
    else if (word && call) kind = "fn";
    html += kind ? `<span class="tok-${kind}">${escapeHtml(text)}</span>` : escapeHtml(text);
    last = match.index + text.length;
  }
  return html + escapeHtml(code.slice(last));
}

// --- inline ---------------------------------------------------------------------------------------

const SAFE_URL = /^(https?:\/\/|mailto:)/i;

function link(url, labelHtml) {
  return `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${labelHtml}</a>`;
}

function emphasis(html) {
  return html
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/\*(?=[^\s*])([^*]*?[^\s*])\*/g, "<em>$1</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}

/** One block's inline Markdown as HTML (line breaks kept as <br>). */
export function renderInline(source) {
  const slots = [];
  const hold = (html) => `\u0000${slots.push(html) - 1}\u0000`;
  let text = String(source).replace(/\u0000/g, "");
  text = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) =>
    hold(`<code>${escapeHtml(/^ .* $/.test(code) ? code.slice(1, -1) : code)}</code>`),
  );
  text = text.replace(/\[([^\]\n]+)\]\(\s*<?([^\s)>]+)>?(?:\s+"[^"\n]*")?\s*\)/g, (whole, label, url) =>
    SAFE_URL.test(url) ? hold(link(url, emphasis(escapeHtml(label)))) : whole,
  );
  text = text.replace(/<?\bhttps?:\/\/[^\s<>"'`]*[^\s<>"'`.,:;!?)\]]>?/g, (url) => {
    const bare = url.replace(/^<|>$/g, "");
    return hold(link(bare, escapeHtml(bare)));
  });
  text = emphasis(escapeHtml(text)).replace(/ *\n/g, "<br>");
  return text.replace(/\u0000(\d+)\u0000/g, (_, n) => slots[Number(n)]);
}

// --- blocks ---------------------------------------------------------------------------------------

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

const blank = (line) => /^\s*$/.test(line);
const indentOf = (line) => line.match(/^\s*/)[0].replace(/\t/g, "    ").length;

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function codeBlock(code, lang) {
  const label = escapeHtml(lang || "text");
  return (
    `<div class="codeblock"><div class="code-head"><span>${label}</span>` +
    `<button type="button" class="copy" data-copy>Copy</button></div>` +
    `<pre><code>${highlight(code, lang)}</code></pre></div>`
  );
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function table(lines, start) {
  const head = splitRow(lines[start]);
  const aligns = splitRow(lines[start + 1]).map((cell) =>
    cell.startsWith(":") && cell.endsWith(":") ? "center" : cell.endsWith(":") ? "right" : cell.startsWith(":") ? "left" : "",
  );
  const cell = (tag, text, i) => {
    const align = aligns[i] ? ` align="${aligns[i]}"` : "";
    return `<${tag}${align}>${renderInline(text)}</${tag}>`;
  };
  let html = `<table><thead><tr>${head.map((text, i) => cell("th", text, i)).join("")}</tr></thead><tbody>`;
  let i = start + 2;
  for (; i < lines.length && !blank(lines[i]) && lines[i].includes("|"); i++) {
    const cells = splitRow(lines[i]);
    html += `<tr>${head.map((_, c) => cell("td", cells[c] ?? "", c)).join("")}</tr>`;
  }
  return [html + "</tbody></table>", i];
}

function list(lines, start) {
  const first = lines[start].match(ITEM);
  const base = indentOf(first[1]);
  const ordered = /\d/.test(first[2]);
  const items = [];
  let current = null;
  let i = start;
  while (i < lines.length) {
    const line = lines[i];
    const item = line.match(ITEM);
    if (item && indentOf(item[1]) <= base + 1) {
      if (/\d/.test(item[2]) !== ordered) break;
      current = [item[3]];
      items.push(current);
      i++;
      continue;
    }
    if (blank(line)) {
      let next = i + 1;
      while (next < lines.length && blank(lines[next])) next++;
      if (next < lines.length && (indentOf(lines[next]) > base || ITEM.test(lines[next]))) {
        const nextItem = lines[next].match(ITEM);
        if (nextItem && indentOf(nextItem[1]) <= base + 1 && /\d/.test(nextItem[2]) !== ordered) break;
        current.push("");
        i++;
        continue;
      }
      break;
    }
    if (indentOf(line) > base) {
      current.push(line.replace(/^\s+/, (space) => space.slice(Math.min(space.length, base + 2))));
      i++;
      continue;
    }
    if (!startsBlock(line)) {
      current.push(line); // a lazy continuation of the item's paragraph
      i++;
      continue;
    }
    break;
  }
  const tag = ordered ? "ol" : "ul";
  const number = ordered ? parseInt(first[2], 10) : 1;
  const open = ordered && number !== 1 ? `<ol start="${number}">` : `<${tag}>`;
  const body = items
    .map((item) => {
      const html = renderMarkdown(item.join("\n"));
      // A one-paragraph item (maybe with a nested list) shows its text without the <p>.
      return `<li>${html.replace(/^<p>([\s\S]*?)<\/p>(?=\n<[uo]l|$)/, "$1")}</li>`;
    })
    .join("");
  return [`${open}${body}</${tag}>`, i];
}

/** Markdown source → safe HTML. */
export function renderMarkdown(source) {
  const lines = String(source).replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (blank(line)) {
      i++;
      continue;
    }
    const fence = line.match(FENCE);
    if (fence) {
      const closing = new RegExp(`^ {0,3}${fence[1][0] === "`" ? "`" : "~"}{${fence[1].length},}\\s*$`);
      const body = [];
      for (i++; i < lines.length && !closing.test(lines[i]); i++) body.push(lines[i]);
      i++; // the closing fence (or the end: a block still streaming shows as code already)
      blocks.push(codeBlock(body.join("\n"), fence[2]));
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      const level = heading[1].length;
      blocks.push(`<h${level}>${renderInline(heading[2] || "")}</h${level}>`);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      blocks.push("<hr>");
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && !blank(lines[i]); i++) quoted.push(lines[i].replace(QUOTE, ""));
      blocks.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
      continue;
    }
    if (ITEM.test(line)) {
      const [html, next] = list(lines, i);
      blocks.push(html);
      i = next;
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const [html, next] = table(lines, i);
      blocks.push(html);
      i = next;
      continue;
    }
    const paragraph = [line];
    for (i++; i < lines.length && !blank(lines[i]) && !startsBlock(lines[i]); i++) paragraph.push(lines[i]);
    blocks.push(`<p>${renderInline(paragraph.join("\n"))}</p>`);
  }
  return blocks.join("\n");
}
