// thunderpool dashboard: polls /health, /v1/cluster, /metrics and /v1/stats/history once a
// second and renders them. The history is the server's (a page opened late still shows the
// past); only its new points are fetched. Plain DOM code with no dependencies; every field of
// the API's JSON is treated as optional.
"use strict";

const POLL_MS = 1000;
const SPARK_POINTS = 60;  // the fallback sparkline, from this page's own polls
const HISTORY_S = 600;  // what the charts span
// One color per rank, shared by node cards and the placement view so they can be matched by eye.
const RANK_COLORS = ["#4f8cff", "#f59e0b", "#10b981", "#ef4444", "#a855f7", "#06b6d4",
  "#ec4899", "#84cc16"];

const byId = (id) => document.getElementById(id);
const tokHistory = [];
let history = [];  // the server's points, oldest first
let lastClusterKey = "";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else if (key === "style") {
      // setProperty, not assignment: custom properties like --rank-color need it.
      for (const [prop, v] of Object.entries(value)) node.style.setProperty(prop, v);
    }
    else if (key.startsWith("data-")) node.setAttribute(key, String(value));
    else node[key] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const isNum = (x) => typeof x === "number" && Number.isFinite(x);
const rankColor = (rank) => RANK_COLORS[(isNum(rank) ? rank : 0) % RANK_COLORS.length];

function fmtBytes(n) {
  if (!isNum(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i === 0 || n >= 100 ? 0 : 1)} ${units[i]}`;
}

function fmtNum(n, digits = 1) {
  if (!isNum(n)) return "—";
  return n.toLocaleString("en-US", { maximumFractionDigits: digits });
}

function fmtSeconds(s) {
  if (!isNum(s)) return "—";
  return s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms` : `${s.toFixed(2)} s`;
}

function fmtLatency(ms) {
  if (!isNum(ms)) return "—";
  return ms < 1 ? `${(ms * 1000).toFixed(0)} µs` : `${ms.toFixed(ms < 10 ? 2 : 1)} ms`;
}

// Prometheus text exposition -> {name: [{labels, value}]}; skips comments and malformed lines.
function parseMetrics(text) {
  const out = {};
  const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)/;
  for (const raw of text.split("\n")) {
    const s = raw.trim();
    if (!s || s.startsWith("#")) continue;
    const m = line.exec(s);
    if (!m) continue;
    const labels = {};
    for (const pair of (m[3] || "").matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
      labels[pair[1]] = pair[2];
    }
    const value = Number(m[4]);
    if (Number.isNaN(value)) continue;
    (out[m[1]] ||= []).push({ labels, value });
  }
  return out;
}

// The single value of a metric without labels (or the sum over its series), or null.
function metricValue(metrics, name) {
  const series = metrics[name];
  if (!series || !series.length) return null;
  return series.reduce((sum, s) => sum + s.value, 0);
}

function renderHealth(res, body) {
  const state = byId("cluster-state");
  const loading = byId("loading");
  if (!res) {
    state.textContent = "unreachable";
    state.dataset.state = "down";
    loading.hidden = true;
    return;
  }
  const status = (body && body.status) || (res.ok ? "ok" : `http ${res.status}`);
  if (status === "loading" || status === "recovering") {
    // recovering: a node was lost and a new instance is loading on the nodes left.
    const p = isNum(body.progress) ? Math.max(0, Math.min(1, body.progress)) : 0;
    state.textContent = `${status} ${Math.round(p * 100)}%`;
    state.dataset.state = "loading";
    loading.hidden = false;
    byId("loading-bar").style.width = `${p * 100}%`;
    const what = status === "loading" ? "loading model" : `recovering (${body.detail || ""})`;
    byId("loading-text").textContent = `${what}… ${Math.round(p * 100)}%`;
  } else {
    state.textContent = status === "ok" ? "ready" : status;
    state.dataset.state = status === "ok" ? "ready" : "down";
    loading.hidden = true;
  }
}

function memoryBar(node) {
  const total = node.memory_total_bytes;
  const bar = el("div", { class: "membar", title: "params | other used | free" });
  if (!isNum(total) || total <= 0) return bar;
  const pct = (x) => `${Math.max(0, Math.min(100, (x / total) * 100))}%`;
  const params = isNum(node.param_bytes) ? node.param_bytes : 0;
  const used = isNum(node.memory_used_bytes) ? Math.max(node.memory_used_bytes, params) : params;
  bar.append(el("div", { class: "seg params", style: { width: pct(params) } }));
  bar.append(el("div", { class: "seg used", style: { width: pct(used - params) } }));
  if (isNum(node.peak_rss_bytes)) {
    const style = { left: pct(node.peak_rss_bytes) };
    bar.append(el("div", { class: "peak", title: "peak RSS", style }));
  }
  return bar;
}

function nodeCard(node) {
  const rank = node.rank;
  const bw = node.speed ? node.speed.mem_bw_gbps : null;
  const speed = isNum(bw) ? `${fmtNum(bw, 0)} GB/s` : "—";
  const row = (label, value) =>
    el("div", { class: "kv" }, el("span", { class: "label" }, label), el("span", {}, value));
  return el("div", {
    class: "node-card",
    "data-name": node.name ?? "",
    "data-rank": isNum(rank) ? rank : "",
    style: { "--rank-color": rankColor(rank) },
  },
  el("div", { class: "card-head" },
    el("span", { class: "swatch" }),
    el("span", { class: "node-name" }, node.name ?? "(unnamed)"),
    isNum(rank) ? el("span", { class: "badge" }, `rank ${rank}`) : null),
  node.host ? el("div", { class: "host muted" }, node.host) : null,
  memoryBar(node),
  el("div", { class: "membar-caption muted" },
    `${fmtBytes(node.memory_used_bytes)} used of ${fmtBytes(node.memory_total_bytes)}`),
  row("params", fmtBytes(node.param_bytes)),
  row("RSS", fmtBytes(node.rss_bytes)),
  row("peak RSS", fmtBytes(node.peak_rss_bytes)),
  row("memory bandwidth", speed),
  row("BLAS", node.blas ?? "—"),
  row("backend", node.backend ?? (node.blas ? "none" : "—")));
}

function renderNodes(nodes) {
  const box = byId("nodes");
  box.replaceChildren(...nodes.map(nodeCard));
  if (!nodes.length) box.append(el("p", { class: "muted" }, "no nodes yet"));
}

const isRange = (r) => Array.isArray(r) && r.length === 2 && isNum(r[0]) && isNum(r[1]);

// A track with one segment covering [start, end) of `total`; ranges are half-open like Python's.
function rangeTrack(kind, range, total, color, text) {
  const track = el("div", { class: `track ${kind}` });
  if (isRange(range) && total > 0) {
    track.append(el("div", {
      class: "seg",
      style: {
        left: `${(range[0] / total) * 100}%`,
        width: `${(Math.max(0, range[1] - range[0]) / total) * 100}%`,
        background: color,
      },
    }, text));
  }
  return track;
}

function span(range, unit) {
  if (!isRange(range)) return "—";
  const n = range[1] - range[0];
  return n === 1 ? `${unit} ${range[0]}` : `${unit}s ${range[0]}–${range[1] - 1} (${n})`;
}

function renderPlacement(placement, nodes) {
  const box = byId("placement");
  const ranks = [...((placement && placement.ranks) || [])]
    .sort((a, b) => (a.rank ?? 0) - (b.rank ?? 0));
  const parallel = (placement && placement.parallel) || "";
  box.dataset.parallel = parallel;
  // Hybrid: TP groups per pipeline stage, e.g. "HYBRID 2+2".
  const groups = Array.isArray(placement && placement.groups) ? placement.groups : null;
  byId("parallel-mode").textContent = parallel
    ? parallel.toUpperCase() + (groups ? ` ${groups.join("+")}` : "") : "";
  if (!ranks.length) {
    box.replaceChildren(el("p", { class: "muted" }, "no placement yet"));
    return;
  }
  const nodeOf = {};
  for (const n of nodes) if (isNum(n.rank)) nodeOf[n.rank] = n.name;
  const maxEnd = (key) => Math.max(0, ...ranks.map((r) => (isRange(key(r)) ? key(r)[1] : 0)));
  const nLayers = maxEnd((r) => r.layers);
  const nQ = maxEnd((r) => r.heads && r.heads.q);
  const nKv = maxEnd((r) => r.heads && r.heads.kv);

  const rows = ranks.map((r) => {
    const color = rankColor(r.rank);
    const heads = r.heads || null;
    return el("div", { class: "prow", "data-rank": r.rank ?? "", style: { "--rank-color": color } },
      el("div", { class: "plabel" },
        el("span", { class: "swatch" }),
        `rank ${r.rank ?? "?"}`,
        isNum(r.stage) ? el("span", { class: "muted" }, ` · stage ${r.stage}`) : null,
        el("span", { class: "muted" }, nodeOf[r.rank] ? ` · ${nodeOf[r.rank]}` : "")),
      el("div", { class: "ptracks" },
        rangeTrack("layers", r.layers, nLayers, color, span(r.layers, "layer")),
        heads && nQ ? rangeTrack("heads", heads.q, nQ, color, `q ${span(heads.q, "head")}`) : null,
        heads && nKv
          ? rangeTrack("heads", heads.kv, nKv, color, `kv ${span(heads.kv, "head")}`)
          : null));
  });
  const axis = el("div", { class: "prow axis" }, el("div", { class: "plabel" }),
    el("div", { class: "ptracks muted" },
      el("span", {}, "layer 0"), el("span", {}, `${nLayers} layers`)));
  const legend = nQ ? el("p", { class: "muted small" },
    `${nQ} query heads and ${nKv} KV heads split across ${ranks.length} ranks`) : null;
  box.replaceChildren(...rows, axis, legend ?? "");
}

function renderLinks(links) {
  const body = document.querySelector("#links tbody");
  body.replaceChildren(...links.map((l) => {
    const kind = l.kind || "unknown";
    const addresses = l.a_address && l.b_address ? `${l.a_address} ↔ ${l.b_address}` : null;
    return el("tr", { "data-kind": kind },
      el("td", { title: addresses }, `${l.a ?? "?"} ↔ ${l.b ?? "?"}`),
      el("td", {}, el("span", { class: `kind kind-${kind}` }, kind === "rdma" ? "RDMA" : kind)),
      el("td", { class: "num" }, fmtLatency(l.rtt_ms)),
      el("td", { class: "num" },
        isNum(l.bandwidth_gbps) ? `${fmtNum(l.bandwidth_gbps, 1)} GB/s` : "—"));
  }));
  byId("links").hidden = !links.length;
  byId("links-empty").hidden = links.length > 0;
}

function renderCluster(cluster) {
  // Rebuild only on change, so hover titles and text selection survive the 1 s poll.
  const key = JSON.stringify(cluster);
  if (key === lastClusterKey) return;
  lastClusterKey = key;
  const nodes = Array.isArray(cluster.nodes) ? cluster.nodes : [];
  const model = cluster.model || "—";
  byId("model-name").textContent = model;
  document.title = cluster.model ? `${cluster.model} · thunderpool` : "thunderpool";
  byId("node-count").textContent = String(nodes.length);
  byId("node-count").dataset.count = String(nodes.length);
  renderNodes(nodes);
  renderPlacement(cluster.placement, nodes);
  renderLinks(Array.isArray(cluster.links) ? cluster.links : []);
}

// x of a point at unix time t on a 240-wide chart that ends now and spans HISTORY_S.
function chartX(t, now) {
  return Math.max(0, 240 - ((now - t) / HISTORY_S) * 240);
}

function chartPoints(points, key, top, now) {
  return points.filter((p) => isNum(p[key]))
    .map((p) => `${chartX(p.t, now).toFixed(1)},${(47 - (p[key] / top) * 45).toFixed(1)}`)
    .join(" ");
}

function lastValue(key) {
  for (let i = history.length - 1; i >= 0; i -= 1) if (isNum(history[i][key])) return history[i][key];
  return null;
}

function renderHistory() {
  const now = history.length ? history[history.length - 1].t : 0;
  const shown = history.filter((p) => p.t >= now - HISTORY_S);
  for (const key of ["ttft", "latency"]) {
    byId(`${key}-now`).textContent = fmtSeconds(lastValue(`${key}_s`));
    byId(`${key}-p95`).textContent = fmtSeconds(lastValue(`${key}_p95_s`));
    const values = shown.flatMap((p) => [p[`${key}_s`], p[`${key}_p95_s`]]).filter(isNum);
    const top = Math.max(1e-3, ...values) * 1.25;
    const panel = byId(`${key}-panel`);
    panel.querySelector("polyline.mean").setAttribute("points",
      chartPoints(shown, `${key}_s`, top, now));
    panel.querySelector("polyline.p95").setAttribute("points",
      chartPoints(shown, `${key}_p95_s`, top, now));
  }
  byId("itl-now").textContent = fmtSeconds(lastValue("itl_s"));
  byId("queue-now").textContent = fmtSeconds(lastValue("queue_s"));
}

function renderSparkline() {
  const line = document.querySelector("#sparkline polyline");
  const area = document.querySelector("#sparkline polygon");
  if (history.length >= 2) {
    // The server's history: tok/s over the last HISTORY_S, however long this page has been open.
    const now = history[history.length - 1].t;
    const shown = history.filter((p) => p.t >= now - HISTORY_S && isNum(p.tok_s));
    const top = Math.max(1, ...shown.map((p) => p.tok_s)) * 1.25;
    const points = chartPoints(shown, "tok_s", top, now);
    line.setAttribute("points", points);
    const x0 = shown.length ? chartX(shown[0].t, now).toFixed(1) : "0";
    area.setAttribute("points", `${x0},47 ${points} 240,47`);
    return;
  }
  if (tokHistory.length < 2) {
    line.setAttribute("points", "");
    area.setAttribute("points", "");
    return;
  }
  // Headroom above the peak keeps a steady rate from hugging the top edge.
  const top = Math.max(1, ...tokHistory) * 1.25;
  const step = 240 / (SPARK_POINTS - 1);
  const offset = SPARK_POINTS - tokHistory.length;
  const xy = tokHistory.map((v, i) => [(offset + i) * step, 47 - (v / top) * 45]);
  const points = xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
  line.setAttribute("points", points);
  area.setAttribute("points", `${xy[0][0].toFixed(1)},47 ${points} 240,47`);
}

function renderMetrics(metrics) {
  const tok = metricValue(metrics, "thunderpool_decode_tokens_per_second");
  byId("tok-s").textContent = fmtNum(tok, 1);
  const counts = {
    "queue-depth": "thunderpool_queue_depth",
    "active-requests": "thunderpool_active_requests",
    "requests-total": "thunderpool_requests_total",
    "tokens-total": "thunderpool_tokens_generated_total",
  };
  for (const [id, name] of Object.entries(counts)) {
    byId(id).textContent = fmtNum(metricValue(metrics, name), 0);
  }
  const hits = metricValue(metrics, "thunderpool_prefix_cache_hit_tokens_total");
  const prompted = metricValue(metrics, "thunderpool_prompt_tokens_total");
  byId("cache-hits").textContent =
    isNum(hits) && prompted > 0 ? `${fmtNum((100 * hits) / prompted, 1)}%` : "—";
  if (isNum(tok)) {
    tokHistory.push(tok);
    if (tokHistory.length > SPARK_POINTS) tokHistory.shift();
  }
  renderSparkline();
}

async function pollHistory() {
  const since = history.length ? `?since=${history[history.length - 1].t}` : "";
  const res = await fetch(`/v1/stats/history${since}`, { cache: "no-store", headers: AUTH });
  if (!res.ok) return;
  const body = await res.json();
  const points = Array.isArray(body.points) ? body.points.filter((p) => isNum(p.t)) : [];
  history = history.concat(points);
  const now = history.length ? history[history.length - 1].t : 0;
  history = history.filter((p) => p.t >= now - HISTORY_S);
}

// A server started with --api-key needs it on /v1 and /metrics: open the page as /?key=KEY.
const API_KEY = new URLSearchParams(location.search).get("key");
const AUTH = API_KEY ? { Authorization: `Bearer ${API_KEY}` } : {};

async function fetchJson(path) {
  const res = await fetch(path, { cache: "no-store", headers: AUTH });
  let body = null;
  try { body = await res.json(); } catch { body = null; }
  return { res, body };
}

async function poll() {
  const [health, cluster, metrics] = await Promise.allSettled([
    fetchJson("/health"),
    fetchJson("/v1/cluster"),
    fetch("/metrics", { cache: "no-store", headers: AUTH }).then((r) => (r.ok ? r.text() : "")),
    pollHistory(),
  ]);
  renderHistory();
  if (health.status === "fulfilled") renderHealth(health.value.res, health.value.body);
  else renderHealth(null, null);
  const parsed = metrics.status === "fulfilled" ? parseMetrics(metrics.value) : {};
  renderMetrics(parsed);
  if (cluster.status === "fulfilled" && cluster.value.res.ok && cluster.value.body) {
    renderCluster(cluster.value.body);
  }
  byId("status-line").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

async function loop() {
  try { await poll(); } catch (err) { byId("status-line").textContent = `error: ${err}`; }
  setTimeout(loop, POLL_MS);  // not setInterval: a slow server never gets overlapping polls
}

loop();
