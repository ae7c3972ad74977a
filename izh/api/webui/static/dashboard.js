// The live dashboard, the browser twin of `izh inspect`: polls /metrics and /v1/izh/stats (one poll at a
// time, each request with a timeout) and draws the KV cache, requests, throughput and latencies.

import { apiFetch, apiKey, askForKey, el, fmt, fmtSeconds, responseError } from "./common.js";
import { Scrape, bucketDelta, histogramQuantile, rate } from "./prom.js";

const POLL_MS = 1000;
const TIMEOUT_MS = 4000;
const HISTORY_S = 300;
const RATE_WINDOW_S = 3;
const LATENCY_WINDOW_S = 60;
const P = "izh:";
const LATENCIES = [
  ["ttft", "Time to first token", `${P}time_to_first_token_seconds`],
  ["itl", "Inter-token latency", `${P}inter_token_latency_seconds`],
  ["e2e", "End to end", `${P}e2e_request_latency_seconds`],
];
const QUANTILES = [0.5, 0.95, 0.99];

const $ = (id) => document.getElementById(id);
const scrapes = []; // recent scrapes, oldest first, for rates and windows
const history = []; // {t, gen, prompt, running, waiting, kv}
let blockStates = [];
let firstUp = null;
let keyPrompt = null;

function setMetric(id, text, value) {
  const node = $(id);
  node.textContent = text;
  if (value !== undefined && value !== null && !Number.isNaN(value)) node.dataset.value = String(value);
  else delete node.dataset.value;
}

/** The newest scrape at least `seconds` older than `now` (else the oldest we have). */
function scrapeBefore(now, seconds) {
  let found = null;
  for (const scrape of scrapes) {
    if (now.time - scrape.time >= seconds * 1000) found = scrape;
    else break;
  }
  return found ?? (scrapes[0] !== now ? scrapes[0] : null);
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function prepareCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  canvas.style.height = `${cssHeight}px`;
  canvas.width = Math.max(1, Math.round(width * ratio));
  canvas.height = Math.round(cssHeight * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, cssHeight);
  return [ctx, width, cssHeight];
}

/** A time-series line chart of `series` ([{key, color}]) over the last HISTORY_S seconds. */
function drawChart(canvas, series, unit) {
  const [ctx, width, height] = prepareCanvas(canvas, 150);
  const left = 44;
  const bottom = height - 18;
  const top = 8;
  const now = performance.now();
  let max = 0;
  for (const point of history) for (const s of series) max = Math.max(max, point[s.key] ?? 0);
  const step = niceStep(max / 3 || 1);
  const ceiling = Math.max(step * 3, step * Math.ceil(max / step));
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = cssVar("--muted");
  ctx.strokeStyle = cssVar("--border");
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let v = 0; v <= ceiling + 1e-9; v += step) {
    const y = bottom - (v / ceiling) * (bottom - top);
    ctx.beginPath();
    ctx.moveTo(left, Math.round(y) + 0.5);
    ctx.lineTo(width, Math.round(y) + 0.5);
    ctx.stroke();
    ctx.fillText(fmt(v, v < 10 && step < 1 ? 1 : 0), left - 6, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "alphabetic";
  for (let minutes = 0; minutes <= HISTORY_S / 60; minutes++) {
    const x = width - (minutes * 60 * (width - left)) / HISTORY_S;
    ctx.fillText(minutes === 0 ? "now" : `−${minutes}m`, Math.min(x, width - 12), height - 3);
  }
  const xOf = (t) => width - ((now - t) / 1000 / HISTORY_S) * (width - left);
  const yOf = (v) => bottom - (v / ceiling) * (bottom - top);
  for (const s of series) {
    const points = history.filter((p) => p[s.key] !== null && p[s.key] !== undefined);
    if (points.length < 2) continue;
    ctx.beginPath();
    points.forEach((p, i) => (i ? ctx.lineTo(xOf(p.t), yOf(p[s.key])) : ctx.moveTo(xOf(p.t), yOf(p[s.key]))));
    ctx.strokeStyle = cssVar(s.color);
    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    ctx.stroke();
    ctx.lineTo(xOf(points[points.length - 1].t), bottom);
    ctx.lineTo(xOf(points[0].t), bottom);
    ctx.closePath();
    ctx.globalAlpha = 0.12;
    ctx.fillStyle = cssVar(s.color);
    ctx.fill();
    ctx.globalAlpha = 1;
  }
  canvas.setAttribute("aria-label", `${unit} over the last ${HISTORY_S / 60} minutes`);
}

function niceStep(raw) {
  const power = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * power >= raw) return m * power;
  return 10 * power;
}

function drawBlockMap() {
  const canvas = $("block-map");
  const n = blockStates.length;
  const width = canvas.clientWidth;
  if (!n) {
    prepareCanvas(canvas, 40);
    return;
  }
  let cell = Math.max(3, Math.min(14, Math.floor(Math.sqrt((width * 180) / n))));
  const columns = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(n / columns);
  const [ctx] = prepareCanvas(canvas, rows * cell);
  const colors = [cssVar("--block-free"), cssVar("--block-cached"), cssVar("--block-used")];
  const gap = cell >= 6 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = colors[blockStates[i]] ?? colors[0];
    ctx.fillRect((i % columns) * cell, Math.floor(i / columns) * cell, cell - gap, cell - gap);
  }
}

function drawAll() {
  drawChart($("gen-chart"), [{ key: "gen", color: "--chart-1" }], "generation tokens per second");
  drawChart($("prompt-chart"), [{ key: "prompt", color: "--chart-2" }], "prompt tokens per second");
  drawChart($("req-chart"), [{ key: "running", color: "--chart-1" }, { key: "waiting", color: "--chart-2" }], "requests");
  drawBlockMap();
}

function showNotice(text) {
  const notice = $("notice");
  notice.textContent = text;
  notice.classList.toggle("hidden", !text);
}

function renderLatencies(cur, windowScrape) {
  const rows = LATENCIES.map(([key, label, name]) => {
    const buckets = cur.buckets(name);
    const windowed = windowScrape ? bucketDelta(buckets, windowScrape.buckets(name)) : null;
    const cells = [];
    for (const source of [windowed, buckets]) {
      for (const q of QUANTILES) {
        const value = source ? histogramQuantile(q, source) : null;
        cells.push(el("td", { "data-latency": `${key}-p${q * 100}-${source === buckets ? "all" : "window"}`, text: fmtSeconds(value) }));
      }
    }
    const count = buckets.length ? buckets[buckets.length - 1][1] : 0;
    return el("tr", {}, el("td", { text: label, title: `${fmt(count, 0)} observations since start` }), ...cells);
  });
  $("latency-body").replaceChildren(...rows);
}

function renderFinishReasons(cur, windowScrape) {
  const name = `${P}request_success_total`;
  const totals = cur.byLabel(name, "finished_reason");
  const before = windowScrape ? windowScrape.byLabel(name, "finished_reason") : {};
  const sum = Object.values(totals).reduce((a, b) => a + b, 0);
  const rows = Object.entries(totals)
    .sort((a, b) => b[1] - a[1])
    .map(([reason, count]) => {
      const bar = el("div");
      bar.style.width = `${sum ? (100 * count) / sum : 0}%`;
      const recent = count - (before[reason] ?? 0);
      return el(
        "div",
        { class: "reason" },
        el("div", { class: "reason-head" }, el("span", { text: reason }), el("span", { class: "sub", "data-reason": reason, "data-value": count, text: `${fmt(count, 0)}${recent > 0 ? `  (+${fmt(recent, 0)} last min)` : ""}` })),
        el("div", { class: "bar" }, bar),
      );
    });
  $("finish-reasons").replaceChildren(...(rows.length ? rows : [el("div", { class: "sub", text: "No finished requests yet." })]));
}

function render(cur, stats) {
  const previous = scrapeBefore(cur, RATE_WINDOW_S);
  const windowScrape = scrapeBefore(cur, LATENCY_WINDOW_S);
  const seconds = previous ? (cur.time - previous.time) / 1000 : 0;
  const counter = (name) => cur.total(`${P}${name}`);
  const before = (name) => (previous ? previous.total(`${P}${name}`) : null);
  const scheduler = stats?.scheduler ?? {};

  const kv = cur.mean(`${P}kv_cache_usage_perc`) ?? scheduler.kv_cache_usage ?? null;
  const running = cur.total(`${P}num_requests_running`) ?? scheduler.num_running ?? null;
  const waiting = cur.total(`${P}num_requests_waiting`) ?? scheduler.num_waiting ?? null;
  const genTotal = counter("generation_tokens_total");
  const promptTotal = counter("prompt_tokens_total");
  const genRate = rate(genTotal, before("generation_tokens_total"), seconds);
  const promptRate = rate(promptTotal, before("prompt_tokens_total"), seconds);
  const preemptions = counter("num_preemptions_total") ?? scheduler.num_preemptions ?? null;
  const windowSeconds = windowScrape ? (cur.time - windowScrape.time) / 1000 : 0;
  const preemptRate = rate(preemptions, windowScrape?.total(`${P}num_preemptions_total`) ?? null, windowSeconds);
  const hits = counter("prefix_cache_hits_total");
  const queries = counter("prefix_cache_queries_total");
  const lifetimeHit = queries ? hits / queries : null;
  let windowHit = null;
  if (windowScrape && queries !== null) {
    const dq = queries - (windowScrape.total(`${P}prefix_cache_queries_total`) ?? 0);
    windowHit = dq > 0 ? (hits - (windowScrape.total(`${P}prefix_cache_hits_total`) ?? 0)) / dq : null;
  }

  setMetric("kv-usage", kv === null ? "—" : `${fmt(kv * 100, 1)}%`, kv);
  $("kv-bar").style.width = `${Math.min(100, (kv ?? 0) * 100)}%`;
  if (blockStates.length) {
    const used = blockStates.filter((s) => s === 2).length;
    const cached = blockStates.filter((s) => s === 1).length;
    $("kv-blocks").textContent = `${fmt(used, 0)} used · ${fmt(cached, 0)} cached · ${fmt(blockStates.length - used - cached, 0)} free of ${fmt(blockStates.length, 0)} blocks`;
    $("block-counts").textContent = `${fmt(blockStates.length, 0)} blocks`;
  }
  setMetric("running", fmt(running, 0), running);
  setMetric("waiting", `${fmt(waiting, 0)} waiting · ${fmt(stats?.num_requests_in_flight ?? null, 0)} in flight`, waiting);
  setMetric("prefix-hit", windowHit === null ? "—" : `${fmt(windowHit * 100, 1)}%`, windowHit);
  setMetric("prefix-hit-lifetime", `${lifetimeHit === null ? "—" : fmt(lifetimeHit * 100, 1) + "%"} since start`, lifetimeHit);
  setMetric("preemptions", fmt(preemptions, 0), preemptions);
  setMetric("preemptions-rate", `${preemptRate === null ? "—" : fmt(preemptRate * 60, 1)} per minute lately`, preemptRate);
  setMetric("gen-rate", fmt(genRate, 1), genRate);
  setMetric("gen-total", `${fmt(genTotal, 0)} tokens since start`, genTotal);
  // Speculative decoding: the share of draft tokens the model accepted (shown once a draft was verified).
  const drafted = counter("spec_decode_num_draft_tokens_total");
  const accepted = counter("spec_decode_num_accepted_tokens_total");
  const acceptance = drafted ? accepted / drafted : null;
  $("spec-accept").hidden = acceptance === null;
  setMetric("spec-accept", `draft acceptance ${acceptance === null ? "—" : fmt(acceptance * 100, 1) + "%"} of ${fmt(drafted, 0)} draft tokens`, acceptance);
  setMetric("prompt-rate", fmt(promptRate, 1), promptRate);
  setMetric("prompt-total", `${fmt(promptTotal, 0)} tokens since start`, promptTotal);
  renderLatencies(cur, windowScrape);
  renderFinishReasons(cur, windowScrape);

  history.push({ t: cur.time, gen: genRate, prompt: promptRate, running, waiting, kv });
  while (history.length && cur.time - history[0].t > HISTORY_S * 1000) history.shift();
  drawAll();
}

function renderStatus(up, stats, text) {
  const dot = $("status-dot");
  const draining = stats?.draining;
  dot.className = `dot ${up ? (draining ? "draining" : "up") : "down"}`;
  $("status-text").textContent = text;
  if (stats?.model) $("model-name").textContent = stats.model;
}

async function fetchStats() {
  const response = await apiFetch("v1/izh/stats", { timeoutMs: TIMEOUT_MS });
  if (response.status === 401) {
    const message = await responseError(response);
    keyPrompt ??= askForKey(async () => {
      const retry = await apiFetch("v1/izh/stats", { timeoutMs: TIMEOUT_MS });
      return retry.ok ? null : await responseError(retry);
    }, apiKey() ? "The saved key was refused." : "").then(() => (keyPrompt = null));
    throw new Error(message);
  }
  if (!response.ok) throw new Error(await responseError(response));
  return response.json();
}

async function fetchMetrics() {
  const response = await apiFetch("metrics", { timeoutMs: TIMEOUT_MS });
  if (!response.ok) throw new Error(await responseError(response));
  return response.text();
}

async function poll() {
  const started = performance.now();
  const [metrics, stats] = await Promise.allSettled([fetchMetrics(), fetchStats()]);
  const problems = [];
  const statsValue = stats.status === "fulfilled" ? stats.value : null;
  if (stats.status === "rejected") problems.push(`/v1/izh/stats: ${stats.reason?.message || stats.reason}`);
  if (statsValue && Array.isArray(statsValue.kv_block_states)) blockStates = statsValue.kv_block_states;
  if (metrics.status === "fulfilled") {
    const scrape = new Scrape(metrics.value, performance.now());
    scrapes.push(scrape);
    while (scrapes.length > 2 && scrape.time - scrapes[1].time > LATENCY_WINDOW_S * 1000) scrapes.shift();
    firstUp ??= Date.now();
    render(scrape, statsValue);
    const start = scrape.total("process_start_time_seconds");
    const uptime = start ? Date.now() / 1000 - start : (Date.now() - firstUp) / 1000;
    const age = statsValue?.stats_age_s;
    renderStatus(true, statsValue, `${statsValue?.draining ? "draining" : "up"} · ${start ? "uptime" : "watched for"} ${duration(uptime)}${age != null ? ` · engine stats ${fmtSeconds(age)} old` : ""} · updated ${new Date().toLocaleTimeString()}`);
  } else {
    problems.unshift(`/metrics: ${metrics.reason?.message || metrics.reason}`);
    renderStatus(false, statsValue, "no answer");
  }
  showNotice(problems.join(" · "));
  const wait = keyPrompt ? keyPrompt : new Promise((resolve) => setTimeout(resolve, Math.max(0, POLL_MS - (performance.now() - started))));
  await wait;
  poll();
}

function duration(seconds) {
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

window.addEventListener("resize", drawAll);
window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", drawAll);
poll();
