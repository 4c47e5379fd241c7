// mlxd's status page: asks for the gateway key, then reads /mlxd/status with it every few seconds
// (`?every=N` seconds; the key never goes in a URL) and draws the document with plain DOM and SVG.
"use strict";

const KEY_NAME = "mlxd-gateway-key";
const DATA_URL = "/mlxd/status";
const SVG = "http://www.w3.org/2000/svg";
const EVERY_S = (() => {
  const asked = Number(new URLSearchParams(location.search).get("every"));
  return asked >= 0.5 && asked <= 60 ? asked : 3;
})();

let timer = null;
let refreshes = 0;

const $ = (id) => document.getElementById(id);

// --- the key: sessionStorage, or localStorage when "remember" was ticked ---------------------------------

function storedKey() {
  return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME);
}

function forgetKey() {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
}

function askForKey(message) {
  clearTimeout(timer);
  forgetKey();
  $("dashboard").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  $("overall").textContent = "key needed";
  $("overall").className = "badge";
  $("key-input").focus();
}

function onKeySubmit(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  $("key-input").value = "";
  (($("remember").checked) ? localStorage : sessionStorage).setItem(KEY_NAME, key);
  $("login").hidden = true;
  refresh();
}

// --- fetching ----------------------------------------------------------------------------------------

async function refresh() {
  clearTimeout(timer);
  const key = storedKey();
  if (!key) {
    askForKey("");
    return;
  }
  try {
    const resp = await fetch(DATA_URL, {headers: {"Authorization": "Bearer " + key}, cache: "no-store"});
    const body = await resp.json().catch(() => null);
    if (resp.status === 401) {
      askForKey((body && body.error && body.error.message) || "the gateway refused the key");
      return;
    }
    if (!resp.ok) {
      showProblem(`the gateway answered ${resp.status}: ${(body && body.error && body.error.message) || ""}`);
    } else {
      showProblem("");
      render(body);
    }
  } catch (err) {
    showProblem("the gateway does not answer (" + err.message + ")");
  }
  timer = setTimeout(refresh, EVERY_S * 1000);
}

function showProblem(text) {
  $("problem").hidden = !text;
  $("problem").textContent = text;
}

// --- formatting ----------------------------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "–";
  if (n === 0) return "0";
  if (n >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  if (n >= 2 ** 20) return (n / 2 ** 20).toFixed(0) + " MiB";
  return n >= 1024 ? (n / 1024).toFixed(0) + " KiB" : n + " B";
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.round((s % 86400) / 3600) + " h";
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit", second: "2-digit"});
}

function when(t, now) {
  const d = new Date(t * 1000);
  const day = now - t < 86400 ? "" : d.toLocaleDateString([], {month: "short", day: "numeric"}) + " ";
  return day + clock(t) + " (" + seconds(now - t) + " ago)";
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function fillTable(id, rows, noneId) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren(...rows.map((cells) => {
    const tr = el("tr");
    if (cells.id) tr.dataset.id = cells.id;
    if (cells.cls) tr.className = cells.cls;
    for (const cell of cells.cells) tr.append(cell instanceof Node ? cell : el("td", cell));
    return tr;
  }));
  $(id).hidden = rows.length === 0;
  if (noneId) $(noneId).hidden = rows.length > 0;
}

// --- rendering -----------------------------------------------------------------------------------------

function render(doc) {
  refreshes += 1;
  document.body.dataset.refreshes = String(refreshes);
  const st = doc.status;
  const health = (st.engine && st.engine.health) || null;
  $("login").hidden = true;
  $("dashboard").hidden = false;
  $("forget").hidden = false;
  $("overall").textContent = st.overall;
  $("overall").className = "badge " + st.overall;
  $("updated").textContent = "updated " + clock(doc.time) + ", every " + EVERY_S + " s";
  renderState(st, health, doc.time);
  renderRequests(health);
  renderHistory(doc.history, doc.time);
  renderJournal(doc.journal, st.crashes, doc.time);
  renderCache(health);
  renderModels(doc.models);
}

function stateRow(list, name, value, id, cls) {
  const dd = el("dd", value, cls);
  if (id) dd.id = id;
  list.append(el("dt", name), dd);
}

function modelLine(h) {
  if (!h) return "–";
  if (!h.resident_model && h.unloaded_idle_at) {
    return `– (idle: ${h.unloaded_idle_model || "the model"} unloaded at ${clock(h.unloaded_idle_at)}; ` +
      "the next request loads it)";
  }
  const notes = [];
  if (h.kv_cache && h.kv_cache.bits < 16) notes.push(`KV ${h.kv_cache.bits}-bit`);
  if (h.tools === "mlxd") notes.push("tools by mlxd");
  if (h.unload_in_s !== null && h.unload_in_s !== undefined) {
    notes.push(`unloads if idle ${seconds(h.unload_in_s)} more`);
  }
  return (h.resident_model || "–") + (notes.length ? ` (${notes.join(", ")})` : "");
}

function renderState(st, h, now) {
  const list = $("state");
  list.replaceChildren();
  const sup = st.supervisord;
  stateRow(list, "supervisord", sup.running ? `running, pid ${sup.pid}` : "not running", "state-supervisord");
  for (const p of st.processes || []) {
    const up = p.uptime_s !== null && p.uptime_s !== undefined ? `, up ${seconds(p.uptime_s)}` : "";
    stateRow(list, `${p.name} process`, `${p.state}, pid ${p.pid || "–"}${up}`);
  }
  if (st.gateway) stateRow(list, "gateway", st.gateway.http_status === 200 ? "ok" : "no answer");
  const engine = h ? `${h.status}${h.reason ? " (" + h.reason + ")" : ""}, ${h.phase || "?"}` : "no answer";
  stateRow(list, "engine", engine, "state-engine", h && h.status === "ok" ? "ok" : "bad");
  stateRow(list, "model", modelLine(h), "resident-model");
  if (h && h.serving) {
    const s = h.serving;
    stateRow(list, "serving", `${s.decoder.replace("_", " ")}, up to ${s.max_concurrency} at once` +
      (s.speculative !== "off" ? `, ${s.speculative.replace("_", " ")}` : "") + (s.reason ? ` (${s.reason})` : ""));
  }
  if (h && h.keep_alive_s !== undefined) {
    stateRow(list, "keep alive", h.keep_alive_s === null ? "always" : seconds(h.keep_alive_s));
  }
  const mem = h && h.memory;
  if (mem) {
    stateRow(list, "memory", `MLX active ${bytes(mem.mlx_active_bytes)}, peak ${bytes(mem.mlx_peak_bytes)}, ` +
      `RSS ${bytes(mem.rss_bytes)} of budget ${bytes(mem.budget_bytes)}` +
      (mem.device_process_bytes ? `, device ${bytes(mem.device_process_bytes)}` : ""));
  }
  const sv = st.supervision;
  if (sv) {
    const at = sv.restart_at ? `, next start in ${seconds(Math.max(0, sv.restart_at - now))}` : "";
    stateRow(list, "supervision", (sv.mode || "?") + at);
  }
  if (st.standby) {
    const sb = st.standby;
    stateRow(list, "standby", sb.pid === null ? "none waiting" : (sb.ready ? `ready, pid ${sb.pid}` :
      `pid ${sb.pid} importing`) + (sb.handovers ? `, ${sb.handovers} takeovers` : ""));
  }
  const c = st.crashes;
  stateRow(list, "crashes", `${c.last_hour} last hour, ${c.last_day} last day` +
    (c.last ? `; last: ${c.last.class} at ${clock(c.last.time)}` : ""), "state-crashes", c.last_hour ? "bad" : "");
  if (st.ollama) {
    const answers = st.ollama.reachable ? `answers (${st.ollama.version})` : "no answer (no fallback while the engine is down)";
    stateRow(list, "ollama", `${answers}, ${st.ollama.url}`);
  }
  stateRow(list, "quarantine", `${st.quarantined_requests} quarantined, ${st.suspected_requests} suspected`,
    "state-quarantine", st.quarantined_requests ? "bad" : "");
  for (const host of st.hosts || []) {
    const hh = host.health;
    stateRow(list, "host", `${host.url}: ${hh && host.http_status === 200 ? hh.status : "no answer"}, model ` +
      `${(hh && hh.resident_model) || "–"} (serves ${host.models.join(", ")})`);
  }
  for (const f of st.foreign_listeners || []) {
    stateRow(list, "warning", `port ${f.port} (${f.used_for}) is held by pid ${f.pid}: ${f.cmdline}`, null, "bad");
  }
  if (st.started_with && st.started_with.env && Object.keys(st.started_with.env).length) {
    stateRow(list, "started with", Object.entries(st.started_with.env).map(([k, v]) => `${k}=${v}`).join(" "));
  }
}

function renderRequests(h) {
  const held = (h && h.requests) || [];
  const queued = (h && h.queue_depth) || 0;
  const running = held.filter((r) => r.status !== "waiting").length;
  const waiting = held.length - running + queued;
  $("request-counts").textContent = `${running} running, ${waiting} queued` +
    (h && h.max_concurrency ? ` (up to ${h.max_concurrency} at once)` : "");
  $("request-counts").dataset.running = String(running);
  $("request-counts").dataset.queued = String(waiting);
  const rows = held.map((r) => ({id: r.id, cls: r.status, cells: [r.id, r.status, seconds(r.for_s)]}));
  if (queued) rows.push({cells: [`${queued} in the admission queue`, "queued", ""]});
  fillTable("requests", rows, "requests-none");
}

// --- plots: inline SVG -------------------------------------------------------------------------------------

const PLOT = {w: 400, h: 150, left: 58, right: 8, top: 8, bottom: 22};  // index.html's viewBox

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawPlot(svgId, legendId, points, series, t0, t1, format) {
  const svg = $(svgId);
  svg.replaceChildren();
  const values = series.flatMap((s) => points.map((p) => p[s.field]).filter((v) => v !== null && v !== undefined));
  const top = Math.max(1e-9, ...values) * 1.1;
  const x = (t) => PLOT.left + (t - t0) / Math.max(1, t1 - t0) * (PLOT.w - PLOT.left - PLOT.right);
  const y = (v) => PLOT.h - PLOT.bottom - v / top * (PLOT.h - PLOT.top - PLOT.bottom);
  for (const frac of [0, 0.5, 1]) {
    const v = top / 1.1 * frac;
    svg.append(svgEl("line", {x1: PLOT.left, x2: PLOT.w - PLOT.right, y1: y(v), y2: y(v), class: "grid"}));
    svg.append(svgEl("text", {x: PLOT.left - 6, y: y(v) + 4, class: "axis end"}, values.length ? format(v) : ""));
  }
  svg.append(svgEl("text", {x: PLOT.left, y: PLOT.h - 6, class: "axis"}, clock(t0)));
  svg.append(svgEl("text", {x: PLOT.w - PLOT.right, y: PLOT.h - 6, class: "axis end"}, "now"));
  const legend = $(legendId);
  legend.replaceChildren();
  series.forEach((s, i) => {
    let d = "";
    let pen = "M";
    for (const p of points) {
      const v = p[s.field];
      if (v === null || v === undefined) {
        pen = "M";  // a gap: the engine did not answer
        continue;
      }
      d += `${pen}${x(p.t).toFixed(1)},${y(v).toFixed(1)} `;
      pen = "L";
    }
    if (d) svg.append(svgEl("path", {d, class: `line s${i}`}));
    const known = points.map((p) => p[s.field]).filter((v) => v !== null && v !== undefined);
    const peak = known.length ? Math.max(...known) : null;
    const now = known.length ? known[known.length - 1] : null;
    const item = el("li", `${s.name} ${now === null ? "–" : format(now)}` +
      (peak !== null && peak !== now ? ` (peak ${format(peak)})` : ""), `s${i}`);
    item.dataset.field = s.field;
    item.dataset.value = now === null ? "" : String(now);
    item.dataset.peak = peak === null ? "" : String(peak);
    legend.append(item);
  });
}

function renderHistory(history, now) {
  const points = history.points;
  // The last hour, or less while the gateway has sampled for less: the plots fill their width.
  const t0 = Math.max(now - history.span_s, Math.min(now - 60, points.length ? points[0].t : now));
  $("history-span").textContent = `since ${clock(t0)}, a sample every ${history.interval_s} s`;
  const device = points.some((p) => p.device_bytes);
  const memory = [
    device ? {name: "device", field: "device_bytes"} : {name: "RSS", field: "rss_bytes"},
    {name: "MLX active", field: "mlx_active_bytes"},
    {name: "MLX cache", field: "mlx_cache_bytes"},
    {name: "prompt cache", field: "prompt_cache_bytes"},
  ];
  drawPlot("plot-memory", "legend-memory", points, memory, t0, now, bytes);
  drawPlot("plot-tokens", "legend-tokens", points, [{name: "tok/s", field: "tok_s"}], t0, now,
    (v) => v.toFixed(v < 10 ? 1 : 0));
  drawPlot("plot-requests", "legend-requests", points,
    [{name: "running", field: "running"}, {name: "queued", field: "queued"}], t0, now,
    (v) => Number.isInteger(v) ? String(v) : v.toFixed(1));
}

// --- the crash journal: a day's strip, then the latest exits --------------------------------------------------

function renderJournal(journal, crashes, now) {
  $("journal-counts").textContent =
    `${crashes.last_hour} crashes in the last hour, ${crashes.last_day} in the last day`;
  const svg = $("timeline");
  svg.replaceChildren();
  const w = 1000, left = 10, right = 10, day = 86400;  // index.html's viewBox
  const x = (t) => left + (t - (now - day)) / day * (w - left - right);
  svg.append(svgEl("line", {x1: left, x2: w - right, y1: 18, y2: 18, class: "grid"}));
  for (const hours of [24, 18, 12, 6, 0]) {
    const align = hours === 24 ? "axis" : (hours ? "axis mid" : "axis end");
    svg.append(svgEl("text", {x: x(now - hours * 3600), y: 38, class: align}, hours ? `-${hours} h` : "now"));
  }
  for (const r of journal.filter((e) => now - e.time <= day)) {
    const dot = svgEl("circle", {cx: x(r.time).toFixed(1), cy: 18, r: 6, class: r.crash ? "crash" : "stop"});
    dot.append(svgEl("title", {}, `${clock(r.time)} ${r.class}${r.model ? " (" + r.model + ")" : ""}`));
    svg.append(dot);
  }
  fillTable("journal", journal.map((r) => ({cls: r.crash ? "crash" : "stop", cells: [
    when(r.time, now), r.class, r.signal || (r.exit_code !== null ? `exit ${r.exit_code}` : "–"), r.model || "–",
    r.request_id || "–", seconds(r.uptime_s),
    r.degraded ? "Ollama serves" : (r.restart_in_s !== null ? `in ${seconds(r.restart_in_s)}` : "–")]})),
  "journal-none");
}

// --- the prompt cache, per conversation ------------------------------------------------------------------------

function renderCache(h) {
  const pc = h && h.prompt_cache;
  if (!pc || !pc.enabled) {
    $("cache-summary").textContent = pc ? "off" : "–";
    fillTable("reuse", [], "reuse-none");
    return;
  }
  $("cache-summary").textContent = `${(pc.hit_rate * 100).toFixed(0)}% of prompt tokens reused ` +
    `(${pc.hits}/${pc.requests} requests hit); memory ${bytes(pc.memory_bytes)} of ${bytes(pc.memory_budget_bytes)} ` +
    `(${pc.memory_entries} entries)` + (pc.disk_enabled ?
    `; disk ${bytes(pc.disk_bytes)} of ${bytes(pc.disk_budget_bytes)} (${pc.disk_entries} entries)` : "; disk off");
  const recent = [...(pc.recent || [])].reverse();  // newest first
  fillTable("reuse", recent.map((r) => ({id: r.conversation, cells: [r.conversation, r.prompt_tokens, r.cached_tokens,
    r.stopped_at === null ? "–" : r.stopped_at, r.why || "–", r.source]})), "reuse-none");
}

// --- the models -------------------------------------------------------------------------------------------------

function renderModels(models) {
  $("models-budget").textContent = `memory budget for a model: ${bytes(models.budget_bytes)}`;
  fillTable("models", models.models.map((m) => {
    const fits = el("td", m.fits ? "yes" : "heavy: Ollama", m.fits ? "ok" : "bad");
    fits.title = m.verdict;
    return {id: m.id, cls: m.state === "loaded" ? "loaded" : "", cells: [m.id, m.kind, m.aliases.join(", ") || "–",
      m.on_disk ? bytes(m.disk_bytes) : "not yet", bytes(m.estimate_bytes), fits, m.state, m.source]};
  }));
}

// --- start ----------------------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", onKeySubmit);
  $("forget").addEventListener("click", () => askForKey(""));
  refresh();
});
