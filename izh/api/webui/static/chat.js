// The chat page: conversations in local storage, streamed replies from /v1/chat/completions (SSE over
// fetch, stoppable), a model picker, a system prompt, sampling settings, and per-message timings.

import { apiFetch, apiKey, askForKey, el, envelopeMessage, fmt, responseError, setApiKey } from "./common.js";
import { renderMarkdown } from "./markdown.js";
import { sseData } from "./sse.js";

const STORE = "izh.conversations";
const CURRENT = "izh.currentConversation";
const SETTINGS = "izh.chatSettings";
const DEFAULT_TITLE = "New chat";

const $ = (id) => document.getElementById(id);
const ui = {
  app: $("app"),
  list: $("conversations"),
  thread: $("thread"),
  scroller: $("messages"),
  form: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  model: $("model"),
  settings: $("settings"),
  settingsToggle: $("settings-toggle"),
  system: $("system-prompt"),
  temperature: $("temperature"),
  topP: $("top-p"),
  maxTokens: $("max-tokens"),
  seed: $("seed"),
  banner: $("banner"),
  forgetKey: $("forget-key"),
};

const state = {
  conversations: [],
  currentId: null,
  models: [],
  streaming: null, // {controller, conversation, message, node}
};

// --- storage --------------------------------------------------------------------------------------

function load() {
  try {
    const stored = JSON.parse(localStorage.getItem(STORE) || "[]");
    state.conversations = Array.isArray(stored) ? stored.filter((c) => c && Array.isArray(c.messages)) : [];
  } catch {
    state.conversations = [];
  }
  for (const conversation of state.conversations) {
    // A reply that was still streaming when the page went away ends there.
    const last = conversation.messages[conversation.messages.length - 1];
    if (last?.role === "assistant" && !last.finish_reason && !last.stopped && !last.error && !last.stats?.completion_tokens) {
      last.stopped = true;
    }
  }
  state.currentId = localStorage.getItem(CURRENT);
  if (!state.conversations.some((c) => c.id === state.currentId)) state.currentId = state.conversations[0]?.id ?? null;
  let settings = {};
  try {
    settings = JSON.parse(localStorage.getItem(SETTINGS) || "{}") || {};
  } catch {
    settings = {};
  }
  ui.system.value = settings.system ?? "";
  ui.temperature.value = settings.temperature ?? "";
  ui.topP.value = settings.top_p ?? "";
  ui.maxTokens.value = settings.max_tokens ?? "";
  ui.seed.value = settings.seed ?? "";
  state.savedModel = settings.model ?? "";
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state.conversations));
    if (state.currentId) localStorage.setItem(CURRENT, state.currentId);
    else localStorage.removeItem(CURRENT);
  } catch (exc) {
    showBanner(`Could not save the conversations in this browser: ${exc.message || exc}`);
  }
}

function saveSettings() {
  const settings = {
    system: ui.system.value,
    temperature: ui.temperature.value,
    top_p: ui.topP.value,
    max_tokens: ui.maxTokens.value,
    seed: ui.seed.value,
    model: ui.model.value,
  };
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function newConversation() {
  const now = Date.now();
  const conversation = { id: `c${now.toString(36)}${Math.random().toString(36).slice(2, 7)}`, title: DEFAULT_TITLE, created: now, updated: now, messages: [] };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  save();
  return conversation;
}

// --- sidebar --------------------------------------------------------------------------------------

function download(filename, data) {
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const anchor = el("a", { href: url, download: filename });
  document.body.append(anchor);
  anchor.click();
  anchor.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function slug(text) {
  return text.toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "").slice(0, 40) || "chat";
}

function renderSidebar() {
  ui.list.replaceChildren(
    ...state.conversations.map((conversation) => {
      const item = el("li", { class: conversation.id === state.currentId ? "current" : "", "data-id": conversation.id });
      const title = el("button", {
        class: "title",
        type: "button",
        title: conversation.title,
        text: conversation.title,
        onclick: () => selectConversation(conversation.id),
      });
      const rename = el("button", { class: "icon rename", type: "button", title: "Rename", "aria-label": "Rename", text: "✎" });
      const exportButton = el("button", { class: "icon export", type: "button", title: "Export as JSON", "aria-label": "Export as JSON", text: "⤓" });
      const remove = el("button", { class: "icon delete", type: "button", title: "Delete", "aria-label": "Delete", text: "✕" });
      rename.addEventListener("click", () => startRename(item, conversation));
      exportButton.addEventListener("click", () => download(`izh-${slug(conversation.title)}.json`, conversation));
      remove.addEventListener("click", () => {
        if (remove.dataset.armed) {
          deleteConversation(conversation.id);
          return;
        }
        remove.dataset.armed = "1";
        remove.textContent = "Delete?";
        remove.classList.add("danger");
        setTimeout(() => {
          delete remove.dataset.armed;
          remove.textContent = "✕";
          remove.classList.remove("danger");
        }, 3000);
      });
      item.append(title, el("span", { class: "actions" }, rename, exportButton, remove));
      return item;
    }),
  );
  ui.forgetKey.classList.toggle("hidden", !apiKey());
}

function startRename(item, conversation) {
  const input = el("input", { type: "text", value: conversation.title, "aria-label": "Conversation title", class: "rename-input" });
  const finish = (commit) => {
    if (commit && input.value.trim()) {
      conversation.title = input.value.trim().slice(0, 120);
      save();
    }
    renderSidebar();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") {
      event.stopPropagation();
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

function deleteConversation(id) {
  if (state.streaming && state.streaming.conversation.id === id) state.streaming.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations[0]?.id ?? null;
  save();
  render();
}

function selectConversation(id) {
  state.currentId = id;
  save();
  ui.app.classList.remove("nav-open");
  render();
  ui.prompt.focus();
}

// --- messages -------------------------------------------------------------------------------------

function toolCallNodes(calls) {
  return calls.map((call) => {
    let args = call.function?.arguments ?? "";
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      // still streaming, or not JSON: show as sent
    }
    return el(
      "div",
      { class: "tool-call" },
      el("div", {}, "Tool call ", el("span", { class: "name", text: call.function?.name || "?" }), call.id ? el("span", { class: "muted", text: ` (${call.id})` }) : null),
      el("pre", {}, el("code", { text: args })),
    );
  });
}

function metaNodes(message) {
  const stats = message.stats || {};
  const items = [];
  if (message.model) items.push(el("span", { class: "model", text: message.model }));
  if (stats.ttft_ms != null) items.push(el("span", { class: "ttft", text: `TTFT ${fmt(stats.ttft_ms, 0)} ms` }));
  if (stats.tokens_per_s != null) items.push(el("span", { class: "tps", text: `${fmt(stats.tokens_per_s, 1)} tok/s` }));
  if (stats.prompt_tokens != null) {
    items.push(el("span", { class: "tokens", text: `${stats.prompt_tokens} prompt + ${stats.completion_tokens} completion tokens` }));
  }
  if (message.finish_reason === "length") items.push(el("span", { class: "stopped", text: "cut at max tokens" }));
  if (message.stopped) items.push(el("span", { class: "stopped", text: "stopped" }));
  return items;
}

function fillMessage(node, message, live) {
  const bubble = node.querySelector(".bubble");
  const parts = [];
  if (message.role === "user") {
    parts.push(el("div", { class: "content", text: message.content }));
  } else {
    if (message.reasoning) {
      const open = live && !message.content;
      const details = el(
        "details",
        { class: "reasoning", open },
        el("summary", { text: live && !message.content ? "Thinking…" : `Reasoning (${message.reasoning.length} characters)` }),
        el("div", { class: "reasoning-text", text: message.reasoning }),
      );
      parts.push(details);
    }
    const content = el("div", { class: "content" });
    content.innerHTML = renderMarkdown(message.content || ""); // renderMarkdown escapes all model text
    if (live && !message.error) content.classList.add("cursor");
    parts.push(content);
    if (message.tool_calls?.length) parts.push(...toolCallNodes(message.tool_calls));
    if (message.error) parts.push(el("div", { class: "error", role: "alert", text: message.error }));
  }
  bubble.replaceChildren(...parts);
  node.querySelector(".meta").replaceChildren(...metaNodes(message));
}

function messageNode(message, live = false) {
  const node = el("div", { class: `msg ${message.role}` }, el("div", { class: "bubble" }), el("div", { class: "meta" }));
  fillMessage(node, message, live);
  return node;
}

function nearBottom() {
  const s = ui.scroller;
  return s.scrollHeight - s.scrollTop - s.clientHeight < 80;
}

function scrollToBottom() {
  ui.scroller.scrollTop = ui.scroller.scrollHeight;
}

function renderThread() {
  const conversation = current();
  if (!conversation || conversation.messages.length === 0) {
    const model = ui.model.value || "the model";
    ui.thread.replaceChildren(
      el(
        "div",
        { class: "empty" },
        el("h1", { text: "What can I help with?" }),
        el("p", { text: `Chatting with ${model}. Enter sends, Shift+Enter adds a line, Esc stops a reply.` }),
      ),
    );
    return;
  }
  ui.thread.replaceChildren(
    ...conversation.messages.map((message) => {
      const live = state.streaming && state.streaming.message === message;
      const node = messageNode(message, live);
      if (live) state.streaming.node = node;
      return node;
    }),
  );
  scrollToBottom();
}

function render() {
  renderSidebar();
  renderThread();
}

function showBanner(text) {
  ui.banner.textContent = text;
  ui.banner.classList.toggle("hidden", !text);
}

// --- sending --------------------------------------------------------------------------------------

function numberSetting(input, name, parse = Number) {
  const raw = input.value.trim();
  if (raw === "") return {};
  const value = parse(raw);
  return { [name]: Number.isNaN(value) ? raw : value };
}

function requestBody(conversation) {
  const messages = [];
  if (ui.system.value.trim()) messages.push({ role: "system", content: ui.system.value });
  for (const message of conversation.messages) {
    if (message === state.streaming?.message) continue;
    if (message.role === "user") messages.push({ role: "user", content: message.content });
    else if (message.role === "assistant" && message.content) messages.push({ role: "assistant", content: message.content });
  }
  return {
    model: ui.model.value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    ...numberSetting(ui.temperature, "temperature"),
    ...numberSetting(ui.topP, "top_p"),
    ...numberSetting(ui.maxTokens, "max_tokens", (v) => parseInt(v, 10)),
    ...numberSetting(ui.seed, "seed", (v) => parseInt(v, 10)),
  };
}

function mergeToolCalls(message, deltas) {
  message.tool_calls ??= [];
  for (const delta of deltas) {
    const index = delta.index ?? message.tool_calls.length;
    const call = (message.tool_calls[index] ??= { id: "", type: "function", function: { name: "", arguments: "" } });
    if (delta.id) call.id = delta.id;
    if (delta.function?.name) call.function.name += delta.function.name;
    if (delta.function?.arguments) call.function.arguments += delta.function.arguments;
  }
}

let frame = 0;
let lastSave = 0;
function scheduleUpdate() {
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    if (performance.now() - lastSave > 2000) {
      lastSave = performance.now();
      save(); // a reload mid-reply keeps what has arrived
    }
    const streaming = state.streaming;
    if (!streaming?.node || !streaming.node.isConnected) return;
    const pinned = nearBottom();
    fillMessage(streaming.node, streaming.message, true);
    if (pinned) scrollToBottom();
  });
}

function setBusy(busy) {
  ui.send.classList.toggle("hidden", busy);
  ui.stop.classList.toggle("hidden", !busy);
}

async function send() {
  const text = ui.prompt.value.trim();
  if (!text || state.streaming) return;
  if (!ui.model.value) {
    showBanner("No model yet: the server's model list has not loaded.");
    return;
  }
  const conversation = current() || newConversation();
  conversation.messages.push({ role: "user", content: text });
  if (conversation.title === DEFAULT_TITLE) conversation.title = text.replace(/\s+/g, " ").slice(0, 60);
  const message = { role: "assistant", content: "", reasoning: "", model: ui.model.value, stats: {} };
  conversation.messages.push(message);
  conversation.updated = Date.now();
  ui.prompt.value = "";
  autosize();
  const controller = new AbortController();
  state.streaming = { controller, conversation, message, node: null };
  save();
  render();
  setBusy(true);
  const started = performance.now();
  let first = null;
  let usage = null;
  try {
    const response = await apiFetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(conversation)),
      signal: controller.signal,
    });
    if (!response.ok) {
      message.error = await responseError(response);
      if (response.status === 401) askKey("The server refused the key.");
      return;
    }
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch {
        continue;
      }
      if (chunk.error) {
        message.error = `Error: ${envelopeMessage(chunk, "the stream failed")}`;
        continue;
      }
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const reasoning = delta.reasoning_content ?? delta.reasoning;
        if (reasoning) message.reasoning += reasoning;
        if (delta.content) message.content += delta.content;
        if (delta.tool_calls) mergeToolCalls(message, delta.tool_calls);
        if (first === null && (reasoning || delta.content || delta.tool_calls)) first = performance.now();
        if (choice.finish_reason) message.finish_reason = choice.finish_reason;
      }
      scheduleUpdate();
    }
  } catch (exc) {
    if (controller.signal.aborted) message.stopped = true;
    else message.error = `Error: could not reach the server (${exc.message || exc})`;
  } finally {
    const ended = performance.now();
    if (first !== null) message.stats.ttft_ms = first - started;
    if (usage) {
      message.stats.prompt_tokens = usage.prompt_tokens;
      message.stats.completion_tokens = usage.completion_tokens;
      if (usage.completion_tokens > 1 && first !== null && ended > first) {
        message.stats.tokens_per_s = (usage.completion_tokens - 1) / ((ended - first) / 1000);
      }
    }
    conversation.updated = Date.now();
    state.streaming = null;
    save();
    if (state.currentId === conversation.id) renderThread();
    setBusy(false);
  }
}

function stop() {
  state.streaming?.controller.abort();
}

// --- models and the key ---------------------------------------------------------------------------

async function fetchModels() {
  const response = await apiFetch("v1/models", { timeoutMs: 15000 });
  if (!response.ok) return { error: await responseError(response), status: response.status };
  const payload = await response.json();
  return { models: (payload.data || []).map((m) => m.id).filter((id) => typeof id === "string") };
}

function fillModels(models) {
  state.models = models;
  const chosen = models.includes(state.savedModel) ? state.savedModel : models[0] || "";
  ui.model.replaceChildren(...models.map((id) => el("option", { value: id, text: id, selected: id === chosen })));
  ui.model.value = chosen;
  if (!current()?.messages.length) renderThread();
}

let asking = null;
function askKey(reason) {
  asking ??= askForKey(async () => {
    const result = await fetchModels();
    if (result.error) return result.error;
    fillModels(result.models);
    return null;
  }, reason).then(() => {
    asking = null;
    renderSidebar();
  });
  return asking;
}

async function loadModels() {
  let result;
  try {
    result = await fetchModels();
  } catch (exc) {
    showBanner(`Cannot reach the server: ${exc.message || exc}`);
    return;
  }
  if (result.status === 401) {
    await askKey(apiKey() ? "The saved key was refused." : "");
    return;
  }
  if (result.error) {
    showBanner(result.error);
    return;
  }
  showBanner("");
  fillModels(result.models);
}

// --- wiring ---------------------------------------------------------------------------------------

function autosize() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight, window.innerHeight * 0.4)}px`;
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.prompt.addEventListener("input", autosize);
ui.stop.addEventListener("click", stop);
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && state.streaming) {
    event.preventDefault();
    stop();
  }
});
$("new-chat").addEventListener("click", () => {
  if (current()?.messages.length === 0) {
    ui.prompt.focus();
    return;
  }
  newConversation();
  ui.app.classList.remove("nav-open");
  render();
  ui.prompt.focus();
});
$("export-all").addEventListener("click", () => download("izh-conversations.json", state.conversations));
ui.forgetKey.addEventListener("click", () => {
  setApiKey("");
  renderSidebar();
  loadModels();
});
$("menu").addEventListener("click", () => ui.app.classList.toggle("nav-open"));
document.querySelector(".main").addEventListener(
  "click",
  (event) => {
    // On a phone, a tap beside the open conversation list closes it.
    if (ui.app.classList.contains("nav-open") && !event.target.closest("#menu")) {
      ui.app.classList.remove("nav-open");
      event.preventDefault();
      event.stopPropagation();
    }
  },
  true,
);
ui.settingsToggle.addEventListener("click", () => {
  const hidden = ui.settings.classList.toggle("hidden");
  ui.settingsToggle.setAttribute("aria-expanded", String(!hidden));
});
for (const input of [ui.system, ui.temperature, ui.topP, ui.maxTokens, ui.seed, ui.model]) {
  input.addEventListener("change", saveSettings);
}
ui.model.addEventListener("change", () => {
  if (!current()?.messages.length) renderThread();
});
ui.thread.addEventListener("click", (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const code = button.closest(".codeblock")?.querySelector("pre")?.textContent ?? "";
  navigator.clipboard?.writeText(code).then(
    () => {
      button.textContent = "Copied";
      setTimeout(() => (button.textContent = "Copy"), 1200);
    },
    () => {},
  );
});

load();
render();
loadModels();
ui.prompt.focus();
