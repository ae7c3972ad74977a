// What both pages share: the API key (kept in this browser's local storage, sent as a bearer token),
// fetch with a timeout, turning an error response into one readable line, and the key dialog.

const KEY_STORAGE = "izh.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

/**
 * fetch(path) with the key as `Authorization: Bearer`. `timeoutMs` bounds the whole exchange, body
 * included; `signal` (the caller's stop) keeps working while the body streams.
 */
export function apiFetch(path, { timeoutMs = 0, signal, headers = {}, ...options } = {}) {
  const allHeaders = { ...headers };
  const key = apiKey();
  if (key) allHeaders.Authorization = `Bearer ${key}`;
  const signals = [signal, timeoutMs ? AbortSignal.timeout(timeoutMs) : null].filter(Boolean);
  const combined = signals.length > 1 && AbortSignal.any ? AbortSignal.any(signals) : signals[0];
  return fetch(path, { ...options, headers: allHeaders, signal: combined });
}

/** The message of an OpenAI error envelope ({"error": {"message", ...}}), else a fallback. */
export function envelopeMessage(payload, fallback) {
  const error = payload && typeof payload === "object" ? payload.error : null;
  if (error && typeof error === "object" && typeof error.message === "string") return error.message;
  if (typeof error === "string") return error;
  return fallback;
}

/** One line for a failed response: status, the server's message, and Retry-After when given. */
export async function responseError(response) {
  let text = "";
  try {
    text = await response.text();
  } catch {
    // the body is gone: the status says enough
  }
  let payload = null;
  try {
    payload = JSON.parse(text);
  } catch {
    payload = null;
  }
  const status = `${response.status}${response.statusText ? " " + response.statusText : ""}`;
  let message = `Error ${status}: ${envelopeMessage(payload, text.trim().slice(0, 500) || "no details")}`;
  const retry = response.headers.get("Retry-After");
  if (retry) message += ` (retry after ${retry} s)`;
  return message;
}

/** A small element builder: el("div", {class: "x", text: "y"}, child, ...). Text is never HTML. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/**
 * Ask for the API key (a modal form). `check(key)` returns null when the key works, else a message
 * to show; the promise resolves once a key passed the check.
 */
export function askForKey(check, reason = "") {
  return new Promise((resolve) => {
    const input = el("input", { type: "password", id: "api-key-input", autocomplete: "off", placeholder: "API key", "aria-label": "API key" });
    const error = el("div", { class: "dialog-error", id: "api-key-error", role: "alert", text: reason });
    const submit = el("button", { class: "primary", type: "submit", id: "api-key-save", text: "Continue" });
    const form = el(
      "form",
      { class: "dialog", id: "api-key-dialog", "aria-labelledby": "api-key-title" },
      el("h2", { id: "api-key-title", text: "API key" }),
      el("p", { text: "This server needs an API key. It is kept in this browser only and sent to this server as a bearer token." }),
      input,
      error,
      el("div", { class: "buttons" }, submit),
    );
    const overlay = el("div", { class: "overlay" }, form);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) {
        error.textContent = "Enter a key.";
        return;
      }
      submit.disabled = true;
      const previous = apiKey();
      setApiKey(key);
      let problem;
      try {
        problem = await check(key);
      } catch (exc) {
        problem = String(exc && exc.message ? exc.message : exc);
      }
      submit.disabled = false;
      if (problem) {
        setApiKey(previous);
        error.textContent = problem;
        input.select();
        return;
      }
      overlay.remove();
      resolve(key);
    });
    document.body.append(overlay);
    input.focus();
  });
}

/** Format a number with a unit-aware precision ("—" when unknown). */
export function fmt(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en-US");
  return value.toFixed(digits);
}

/** Seconds as ms or s, for latencies. */
export function fmtSeconds(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  if (seconds < 1) return `${(seconds * 1000).toFixed(seconds < 0.01 ? 2 : 0)} ms`;
  return `${seconds.toFixed(2)} s`;
}
