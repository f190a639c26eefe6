// gpufleet console: polls the admin API's JSON and draws it. No build step, no library.
// The credential lives in this tab's sessionStorage and goes only in the Authorization
// header; every text from the server is set as textContent (never parsed as HTML).
"use strict";

const KEY = "gpufleet.credential";
const ROLES = ["viewer", "operator", "admin"];
const POLL = { fleet: 1000, events: 2000, quotas: 5000, keys: 10000 };
const state = { role: null, auth: false, lastEvent: 0, timers: [], lastFleet: null, armed: null };
window.gpufleetConsole = state; // for tests and curious operators

const $ = (id) => document.getElementById(id);

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node[name] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

async function api(method, path, body) {
  const headers = { accept: "application/json" };
  const credential = sessionStorage.getItem(KEY);
  if (credential) headers.authorization = "Bearer " + credential;
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store", credentials: "omit",
  });
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const message = data && data.error ? data.error.message : response.statusText;
    const error = new Error(message);
    error.status = response.status;
    throw error;
  }
  return data;
}

const canAct = () => ROLES.indexOf(state.role) >= 1;

// -- signing in ---------------------------------------------------------------------------

async function start() {
  try {
    const who = await api("GET", "/admin/whoami");
    state.role = who.role;
    state.auth = who.auth;
    $("who").textContent = `${who.role} · ${who.actor}`;
    $("signin").hidden = true;
    $("main").hidden = false;
    $("signout").hidden = !who.auth;
    $("tenants-section").hidden = !who.auth;
    $("keys-section").hidden = !(who.auth && canAct());
    poll(refreshFleet, POLL.fleet);
    poll(refreshEvents, POLL.events);
    if (who.auth) poll(refreshQuotas, POLL.quotas);
    if (who.auth && canAct()) poll(refreshKeys, POLL.keys);
  } catch (error) {
    signIn(error.status === 401 && sessionStorage.getItem(KEY) ? error.message : "");
  }
}

function signIn(message) {
  stop();
  $("main").hidden = true;
  $("signout").hidden = true;
  $("signin").hidden = false;
  $("who").textContent = "";
  $("signin-error").textContent = message || "";
  $("credential").focus();
}

function stop() {
  for (const timer of state.timers) clearTimeout(timer);
  state.timers = [];
  state.role = null;
  state.lastEvent = 0;
  $("events").replaceChildren();
  $("pools").replaceChildren();
}

function poll(refresh, every) {
  const run = async () => {
    try {
      await refresh();
      setStatus("");
    } catch (error) {
      if (error.status === 401) {
        sessionStorage.removeItem(KEY);
        signIn(error.message);
        return;
      }
      setStatus(error.message);
    }
    if (state.role) state.timers.push(setTimeout(run, every));
  };
  run();
}

function setStatus(message) {
  $("status").textContent = message || `updated ${new Date().toLocaleTimeString()}`;
}

// -- the fleet ------------------------------------------------------------------------------

const fmt = {
  ms: (s) => (s === null || s === undefined ? "–" : `${(s * 1000).toFixed(s < 0.1 ? 1 : 0)} ms`),
  rate: (r) => (r === null || r === undefined ? "–" : r.toFixed(r < 10 ? 2 : 1)),
  pct: (f) => (f === null || f === undefined ? "–" : `${(f * 100).toFixed(0)} %`),
  n: (v) => (v === null || v === undefined ? "–" : String(v)),
};

async function refreshFleet() {
  const fleet = await api("GET", "/admin/fleet");
  state.lastFleet = fleet;
  const pools = $("pools");
  for (const pool of fleet.pools) {
    let card = pools.querySelector(`[data-pool="${CSS.escape(pool.model)}"]`);
    if (!card) {
      card = buildPool(pool);
      pools.append(card);
    }
    fillPool(card, pool, fleet);
  }
}

function buildPool(pool) {
  const charts = el("div", { class: "charts" });
  for (const [name, title] of [["ttft", "TTFT P50 / P99"], ["rps", "requests / s"], ["kv", "KV cache fill"], ["gpu", "GPU util"]]) {
    charts.append(el("div", { class: "chart" }, el("h3", {}, title), el("canvas", { dataset: { chart: name } })));
  }
  return el(
    "section",
    { class: "pool", dataset: { pool: pool.model } },
    el("h2", {}, pool.model, " ", el("small", {}, `${pool.engine} · ${pool.router}${pool.autoscaled ? " · autoscaled" : ""}`)),
    el("div", { class: "stats" }),
    el("table", {}, el("thead", {}, el("tr", {}, ...["replica", "state", "in flight", "running", "waiting", "KV cache", "GPU", "resident", ""].map((h) => el("th", {}, h)))), el("tbody")),
    charts,
  );
}

function stat(value, label) {
  return el("div", { class: "stat" }, el("b", {}, value), el("span", {}, label));
}

function fillPool(card, pool, fleet) {
  const w = pool.window || {};
  const serving = pool.replicas.filter((r) => r.state !== "stopped").length;
  card.querySelector(".stats").replaceChildren(
    stat(`${pool.routable} / ${serving}`, "routable / replicas"),
    stat(fmt.rate(w.rps), `req/s (${fleet.window_s} s)`),
    stat(`${fmt.ms(w.ttft_p50)} · ${fmt.ms(w.ttft_p99)}`, "TTFT P50 · P99"),
    stat(`${fmt.ms(w.itl_p50)} · ${fmt.ms(w.itl_p99)}`, "ITL P50 · P99"),
    stat(fmt.pct(w.kv), "KV fill (mean)"),
    stat(fmt.n(pool.in_flight), "in flight"),
    stat(`${pool.queued} · ${pool.held}`, "queued · held"),
    stat(fmt.rate(w.errors_per_s), "5xx/s"),
  );
  const rows = pool.replicas.map((r) => replicaRow(pool.model, r));
  card.querySelector("tbody").replaceChildren(...rows);
  const s = pool.series;
  draw(card.querySelector('[data-chart="ttft"]'), s.t, [
    { label: "P50", values: s.ttft_p50, color: "#2f5fd0" },
    { label: "P99", values: s.ttft_p99, color: "#c9253b" },
  ], (v) => fmt.ms(v));
  draw(card.querySelector('[data-chart="rps"]'), s.t, [{ label: "req/s", values: s.rps, color: "#1a7f37" }], (v) => fmt.rate(v));
  draw(card.querySelector('[data-chart="kv"]'), s.t, [{ label: "mean", values: s.kv, color: "#b35900" }], (v) => fmt.pct(v), 1);
  draw(card.querySelector('[data-chart="gpu"]'), s.t, [{ label: "mean", values: s.gpu_util, color: "#6f42c1" }], (v) => fmt.pct(v), 1);
}

function gpuCell(g) {
  // dcgm-exporter's gauges, read while the console is open: utilisation, power, memory
  if (!g) return el("td", { class: "gpu" }, "–");
  const memory = g.memory === null ? "" : ` · ${fmt.pct(g.memory)} mem`;
  const title = `${g.count} GPU${g.count > 1 ? "s" : ""}: utilisation (mean), power (sum), framebuffer used`;
  return el("td", { class: "gpu", title, dataset: { util: String(g.util) } }, `${fmt.pct(g.util)} · ${Math.round(g.power_w)} W${memory}`);
}

function residentCell(r) {
  // residency (serving, sleeping_1, waking, …) and the LoRA adapters it holds, if any
  const parts = [];
  if (r.residency) parts.push(r.residency);
  if (r.adapters) parts.push(r.adapters.length ? `LoRA: ${r.adapters.join(", ")}` : "LoRA: none");
  const title = "Where its model is (sleep mode), and the LoRA adapters it holds, least recently used first";
  return el("td", { class: "resident", title }, parts.length ? parts.join(" · ") : "–");
}

function replicaRow(model, r) {
  const kv = r.kv === null ? null : Math.min(Math.max(r.kv, 0), 1);
  const bar = el("span", { class: kv !== null && kv > 0.9 ? "bar hot" : "bar" }, el("i"));
  bar.firstChild.style.width = `${(kv || 0) * 100}%`;
  let action = null;
  if (canAct() && (r.state === "ready" || r.state === "starting")) {
    const armed = state.armed === r.name;
    action = el("button", {
      class: armed ? "drain armed" : "drain",
      dataset: { drain: r.name },
      title: "No new requests; stopped once its requests are done. The pool keeps one fewer.",
      onclick: (event) => drain(model, r.name, event.currentTarget),
    }, armed ? "Confirm drain" : "Drain");
  }
  return el(
    "tr",
    { dataset: { replica: r.name, state: r.state } },
    el("td", {}, r.name),
    el("td", {}, el("span", { class: `state ${r.state}` }, r.state)),
    el("td", {}, fmt.n(r.in_flight)),
    el("td", {}, fmt.n(r.running)),
    el("td", {}, fmt.n(r.waiting)),
    el("td", {}, bar, fmt.pct(r.kv)),
    gpuCell(r.gpus),
    residentCell(r),
    el("td", {}, action),
  );
}

async function drain(model, name, button) {
  // two clicks: the first arms the button for five seconds, the second drains
  if (state.armed !== name) {
    state.armed = name;
    button.classList.add("armed");
    button.textContent = "Confirm drain";
    setTimeout(() => { if (state.armed === name) state.armed = null; }, 5000);
    return;
  }
  state.armed = null;
  button.disabled = true;
  try {
    await api("POST", `/admin/replicas/${encodeURIComponent(name)}/drain`);
    setStatus(`draining ${name}`);
    await refreshFleet();
    await refreshEvents();
  } catch (error) {
    setStatus(`drain ${name}: ${error.message}`);
  }
}

// -- charts: one canvas each, drawn whole on every poll ----------------------------------------

function draw(canvas, times, lines, label, fixedMax) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (!width || !height) return;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.clearRect(0, 0, width, height);
  const pad = { left: 52, right: 8, top: 14, bottom: 18 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const values = lines.flatMap((l) => l.values.filter((v) => v !== null));
  const top = fixedMax || niceMax(values.length ? Math.max(...values) : 0);
  g.font = "11px system-ui, sans-serif";
  g.strokeStyle = "#e3e6ea";
  g.fillStyle = "#68717d";
  g.lineWidth = 1;
  for (let i = 0; i <= 2; i++) {
    const y = pad.top + plotH - (plotH * i) / 2;
    g.beginPath();
    g.moveTo(pad.left, y);
    g.lineTo(pad.left + plotW, y);
    g.stroke();
    g.textAlign = "right";
    g.fillText(label((top * i) / 2), pad.left - 4, y + 4);
  }
  if (times.length < 2) {
    g.textAlign = "left";
    g.fillText("collecting…", pad.left + 6, pad.top + plotH / 2);
    return;
  }
  const t0 = times[0];
  const span = Math.max(times[times.length - 1] - t0, 1);
  const x = (t) => pad.left + ((t - t0) / span) * plotW;
  const y = (v) => pad.top + plotH - (Math.min(v, top) / top) * plotH;
  g.textAlign = "left";
  g.fillText(`${Math.round(span)} s`, pad.left, height - 4);
  g.textAlign = "right";
  g.fillText("now", pad.left + plotW, height - 4);
  let legend = pad.left + 4;
  for (const line of lines) {
    g.strokeStyle = line.color;
    g.lineWidth = 1.6;
    g.beginPath();
    let open = false;
    line.values.forEach((v, i) => {
      if (v === null) { open = false; return; }
      if (open) g.lineTo(x(times[i]), y(v));
      else g.moveTo(x(times[i]), y(v));
      open = true;
    });
    g.stroke();
    g.fillStyle = line.color;
    g.textAlign = "left";
    g.fillText(line.label, legend, pad.top - 3);
    legend += g.measureText(line.label).width + 12;
  }
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * step) return m * step;
  return 10 * step;
}

// -- events, tenants, keys --------------------------------------------------------------------

async function refreshEvents() {
  const answer = await api("GET", `/admin/events?after=${state.lastEvent}`);
  const list = $("events");
  for (const event of answer.events) {
    const when = new Date(event.time * 1000).toLocaleTimeString();
    list.prepend(el("li", { dataset: { kind: event.kind } },
      el("time", {}, when), el("span", { class: `kind ${event.kind}` }, event.kind), event.text));
    state.lastEvent = Math.max(state.lastEvent, event.seq);
  }
  while (list.children.length > 200) list.lastChild.remove();
}

function used(part) {
  if (part.limit === null) return `${part.used}`;
  const share = Math.min(part.used / part.limit, 1);
  const bar = el("span", { class: share > 0.9 ? "bar hot" : "bar" }, el("i"));
  bar.firstChild.style.width = `${share * 100}%`;
  return el("span", {}, bar, `${part.used} / ${part.limit}`);
}

async function refreshQuotas() {
  const answer = await api("GET", "/admin/quotas");
  const rows = answer.tenants.map((t) => el("tr", { dataset: { tenant: t.name } },
    el("td", {}, t.name, " ", el("small", {}, `${t.priority}, weight ${t.weight}`)),
    el("td", {}, used(t.rpm)), el("td", {}, used(t.tpm)), el("td", {}, used(t.concurrency)),
    el("td", {}, `${t.last_hour.requests} req · ${t.last_hour.tokens} tok`)));
  $("tenants").querySelector("tbody").replaceChildren(...rows);
}

async function refreshKeys() {
  const keys = await api("GET", "/admin/keys");
  const rows = keys.map((k) => el("tr", { dataset: { key: k.key_id } },
    el("td", {}, el("code", {}, k.key_id)), el("td", {}, k.tenant),
    el("td", {}, new Date(k.created_at * 1000).toLocaleString()),
    el("td", {}, el("button", { class: "drain", onclick: (e) => revoke(k.key_id, e.currentTarget) }, "Revoke"))));
  $("keys").querySelector("tbody").replaceChildren(...rows);
}

async function revoke(keyId, button) {
  if (button.textContent !== "Confirm revoke") {
    button.textContent = "Confirm revoke";
    button.classList.add("armed");
    return;
  }
  button.disabled = true;
  try {
    await api("DELETE", `/admin/keys/${encodeURIComponent(keyId)}`);
    setStatus(`revoked ${keyId}`);
    await refreshKeys();
  } catch (error) {
    setStatus(`revoke ${keyId}: ${error.message}`);
  }
}

// -- wiring -----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("credential").value.trim();
    $("credential").value = "";
    if (!value) return;
    sessionStorage.setItem(KEY, value);
    start();
  });
  $("signout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    signIn("");
  });
  start();
});
