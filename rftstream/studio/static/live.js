// rftstream studio: the live view of one run, polled from /api/runs/<run> every 2 s.
"use strict";

const POLL_MS = 2000;
let current = new URLSearchParams(location.search).get("run") || "";
let timer = null;

function fill(tableId, rows) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.textContent = "";
  for (const cells of rows) {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = c === null || c === undefined ? "" : String(c);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "";
  return seconds < 90 ? `${seconds.toFixed(1)} s` : `${(seconds / 60).toFixed(1)} min`;
}

function card(label, value) {
  const d = document.createElement("div");
  d.className = "card";
  const v = document.createElement("div");
  v.className = "v";
  v.textContent = value === null || value === undefined ? "–" : String(value);
  const k = document.createElement("div");
  k.className = "k";
  k.textContent = label;
  d.append(v, k);
  return d;
}

// one curve as an SVG line chart: points [[step, value], ...]; smooth (optional):
// {points, span, raw_alpha} from the server (metrics.png's EMA): the raw line faint, the
// smoothed one bold
function chart(title, points, smooth) {
  const W = 460, H = 200, L = 50, R = 10, T = 10, B = 30;
  const NS = "http://www.w3.org/2000/svg";
  const box = document.createElement("div");
  box.className = "chart";
  const h = document.createElement("h3");
  const note = smooth ? (smooth.span > 1 ? `, EMA span ${smooth.span} steps, raw faint` : ", raw") : "";
  h.textContent = `${title} (${points.length} steps${note})`;
  box.appendChild(h);
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", W);
  svg.setAttribute("height", H);
  const text = (x, y, s, anchor) => {
    const t = document.createElementNS(NS, "text");
    t.setAttribute("x", x); t.setAttribute("y", y);
    t.setAttribute("font-size", "11"); t.setAttribute("text-anchor", anchor || "middle");
    t.textContent = s;
    svg.appendChild(t);
  };
  const axis = document.createElementNS(NS, "path");
  axis.setAttribute("d", `M${L},${T} V${H - B} H${W - R}`);
  axis.setAttribute("stroke", "#888"); axis.setAttribute("fill", "none");
  svg.appendChild(axis);
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    const polyline = (pts, cls, width, opacity) => {
      const line = document.createElementNS(NS, "polyline");
      line.setAttribute("points", pts.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "));
      line.setAttribute("class", cls);
      line.setAttribute("fill", "none"); line.setAttribute("stroke", "#2b6cd4");
      line.setAttribute("stroke-width", width); line.setAttribute("stroke-opacity", opacity);
      svg.appendChild(line);
    };
    const rawOpacity = smooth ? smooth.raw_alpha : 1;
    polyline(points, "raw", smooth ? "1" : "2", rawOpacity);
    for (const p of points.length <= 60 ? points : []) {
      const c = document.createElementNS(NS, "circle");
      c.setAttribute("cx", sx(p[0])); c.setAttribute("cy", sy(p[1])); c.setAttribute("r", 3);
      c.setAttribute("fill", "#2b6cd4"); c.setAttribute("fill-opacity", rawOpacity);
      svg.appendChild(c);
    }
    if (smooth) polyline(smooth.points, "smoothed", "2", 1);
    text(L - 4, T + 10, y1.toPrecision(3), "end");
    text(L - 4, H - B, y0.toPrecision(3), "end");
    text(L, H - 8, `step ${x0}`, "start");
    text(W - R, H - 8, `step ${x1}`, "end");
  } else {
    text(W / 2, H / 2, "no trainer step yet");
  }
  box.appendChild(svg);
  return box;
}

function renderRun(d) {
  const s = d.status;
  const cards = document.getElementById("cards");
  cards.textContent = "";
  cards.append(
    card("status", d.status_value || "unknown"),
    card("trainer step", s.trainer.step),
    card("weights version", s.weights.version),
  );
  for (const e of s.explorers) {
    cards.append(card(`${e.name} step / staleness`, `${e.step ?? "–"} / ${e.staleness ?? "–"}`));
  }
  cards.append(card("dead letters", d.dead_letters.count));
  document.getElementById("chain").textContent = s.chain + (s.waiting ? `  (trainer: ${s.waiting})` : "");
  const charts = document.getElementById("charts");
  charts.textContent = "";
  for (const key of Object.keys(d.curves)) {
    charts.appendChild(chart(d.curve_labels[key] || key, d.curves[key], (d.smoothed || {})[key]));
  }
  const stageRows = [], consumerRows = [];
  for (const st of d.streams) {
    if (st.missing) { stageRows.push([st.name, "(not created yet)", ""]); continue; }
    const subjects = Object.entries(st.subjects);
    if (!subjects.length) stageRows.push([st.name, "(empty)", st.messages]);
    for (const [subject, n] of subjects) stageRows.push([st.name, subject, n]);
    for (const c of st.consumers) consumerRows.push([st.name, c.name, c.filter, c.pending, c.ack_pending, c.redelivered]);
  }
  fill("stages", stageRows);
  fill("consumers", consumerRows);
  fill("heartbeats", s.heartbeats.map((h) => [h.actor, h.role, age(h.age), JSON.stringify(h.info)]));
  document.getElementById("dlq-count").textContent = `(${d.dead_letters.count})`;
  fill("dead-letters", d.dead_letters.messages.map((m) => {
    const dl = m.dead_letter || {};
    return [m.seq, dl["Rft-Dlq-Stage"], dl["Rft-Dlq-Actor"], dl["Rft-Dlq-Reason"], m.group ?? m.task ?? ""];
  }));
  document.getElementById("run-view").style.display = "";
}

// a failed read of the run the studio started: say what its `up` is doing
function explain(message) {
  const l = window.studioLaunch;
  if (!l || l.run !== current) return message;
  if (l.state === "exited" && l.outcome === "failed") {
    return `rftstream up of run ${current} failed (exit code ${l.exit_code}): its output is above. ${message}`;
  }
  if (l.state !== "exited" && document.getElementById("run-view").style.display === "none") {
    return `waiting for run ${current}: rftstream up is starting (${message})`;
  }
  return message;
}

async function poll() {
  clearTimeout(timer);
  if (!current) return;
  try {
    const resp = await fetch(`/api/runs/${encodeURIComponent(current)}`);
    const d = await resp.json();
    if (!d.ok) throw new Error(d.error);
    document.getElementById("live-error").textContent = "";
    renderRun(d);
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.run = current;
  } catch (e) {
    document.getElementById("live-error").textContent = explain(String(e.message || e));
  }
  timer = setTimeout(poll, POLL_MS);
}

async function loadRuns() {
  const sel = document.getElementById("run-select");
  try {
    const d = await (await fetch("/api/runs")).json();
    if (!d.ok) throw new Error(d.error);
    const nats = document.getElementById("nats");
    nats.textContent = `on ${d.nats}` + (d.nats_error ? " (not reachable)" : "");
    nats.title = d.nats_error || "";
    sel.textContent = "";
    const none = document.createElement("option");
    none.value = "";
    none.textContent = d.runs.length ? "(pick a run)" : "(no run on this server)";
    sel.appendChild(none);
    for (const r of d.runs) {
      const o = document.createElement("option");
      o.value = r.run;
      o.textContent = `${r.run} (${r.status}${r.heartbeat_age != null ? ", heartbeat " + age(r.heartbeat_age) + " ago" : ""})`;
      sel.appendChild(o);
    }
    if (!current && d.runs.length === 1) current = d.runs[0].run;
    if (current && !d.runs.some((r) => r.run === current)) {
      const o = document.createElement("option");
      o.value = current;
      o.textContent = `${current} (not on the server yet)`;
      sel.appendChild(o);
    }
    sel.value = current;
  } catch (e) {
    document.getElementById("live-error").textContent = String(e.message || e);
  }
  document.body.dataset.ready = "1";
}

document.getElementById("run-select").addEventListener("change", (ev) => {
  current = ev.target.value;
  history.replaceState(null, "", current ? `/live?run=${encodeURIComponent(current)}` : "/live");
  document.getElementById("run-view").style.display = "none";
  poll();
});

loadRuns().then(poll);
setInterval(loadRuns, 10000);  // runs started or finished meanwhile
