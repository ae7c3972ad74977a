// Server-sent events from a fetch() response body: yields each event's data (the `data:` lines joined
// by "\n"), skipping comments (izh's keep-alives) and other fields. Ends when the body ends.

export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  const lineOf = (line) => {
    if (line === "") {
      const event = data.length ? data.join("\n") : null;
      data = [];
      return event;
    }
    if (line.startsWith(":")) return null;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") data.push(value);
    return null;
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      // A trailing "\r" may be the first half of "\r\n": keep it with the unfinished last line.
      const held = !done && buffer.endsWith("\r") ? "\r" : "";
      const lines = (held ? buffer.slice(0, -1) : buffer).split(/\r\n|\r|\n/);
      buffer = done ? "" : lines.pop() + held;
      for (const line of lines) {
        const event = lineOf(line);
        if (event !== null) yield event;
      }
      if (done) break;
    }
    const last = lineOf("");
    if (last !== null) yield last;
  } finally {
    reader.cancel().catch(() => {}); // a consumer that stops early (at [DONE]) lets go of the body
  }
}
