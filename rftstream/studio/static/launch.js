// rftstream studio: the run started from the studio (`rftstream up` in a child process),
// polled from /api/launch every 2 s and shown in #launch on both pages, with its Stop
// button (POST /api/launch/stop: SIGINT, as Ctrl-C) and the end of its output.
"use strict";

const LAUNCH_POLL_MS = 2000;
window.studioLaunch = null;  // the newest /api/launch state (null: none started)
let launchTimer = null;
let launchShownFailed = null;  // the launch whose failure opened the output once

function launchEl(tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined) el.textContent = text;
  return el;
}

// the panel's elements, made once (the <details> keeps the user's open/closed choice)
function launchPanel() {
  const root = document.getElementById("launch");
  if (root.dataset.built) return root;
  const head = launchEl("div", "launch-head");
  const state = launchEl("span", "launch-state");
  state.id = "launch-state";
  const what = launchEl("span", "launch-what");
  what.id = "launch-what";
  const stop = launchEl("button", "", "Stop");
  stop.type = "button";
  stop.id = "stop";
  stop.title = "stop the run as Ctrl-C would (SIGINT to rftstream up): it shuts down cleanly and can be continued later";
  stop.addEventListener("click", stopLaunch);
  const live = launchEl("a", "launch-live", "live view");
  live.id = "launch-live";
  head.append(state, what, stop, live);
  const detail = launchEl("div", "launch-detail");
  detail.id = "launch-detail";
  const message = launchEl("div", "banner-error");
  message.id = "launch-message";
  const output = launchEl("details", "launch-output");
  output.id = "launch-output";
  output.append(launchEl("summary", "", "output of rftstream up (the last lines)"));
  const tail = launchEl("pre", "launch-tail");
  tail.id = "launch-tail";
  output.appendChild(tail);
  root.append(head, detail, message, output);
  root.dataset.built = "1";
  return root;
}

function launchStateText(l) {
  if (l.state === "running") return "running";
  if (l.state === "stopping") return "stopping (SIGINT sent)";
  const code = l.exit_code < 0 ? `killed by signal ${-l.exit_code}` : `exit code ${l.exit_code}`;
  return `${l.outcome} (${code})`;
}

function renderLaunch(l) {
  const root = document.getElementById("launch");
  window.studioLaunch = l;
  if (!l) { root.hidden = true; return; }
  launchPanel();
  root.hidden = false;
  root.dataset.state = l.state;
  root.dataset.run = l.run;
  root.dataset.outcome = l.outcome || "";
  root.dataset.exitCode = l.exit_code === null ? "" : String(l.exit_code);
  const state = document.getElementById("launch-state");
  state.textContent = launchStateText(l);
  state.className = "launch-state " + (l.outcome || l.state);
  const started = new Date(l.started * 1000).toLocaleTimeString();
  document.getElementById("launch-what").textContent =
    `run ${l.name}` + (l.name !== l.run ? ` (${l.run})` : "") +
    ` started from the studio at ${started}: rftstream up, pid ${l.pid}`;
  document.getElementById("stop").style.display = l.state === "running" ? "" : "none";
  const live = document.getElementById("launch-live");
  const viewing = location.pathname === "/live" &&
    new URLSearchParams(location.search).get("run") === l.run;
  live.href = l.live_url;
  live.style.display = viewing ? "none" : "";
  const detail = document.getElementById("launch-detail");
  detail.textContent = "";
  const line = (label, text, code) => {
    const div = launchEl("div");
    div.append(document.createTextNode(label + " "));
    div.append(launchEl(code ? "code" : "span", "", text));
    detail.appendChild(div);
  };
  line("run dir:", l.run_dir, true);
  line("NATS:", l.nats_note || l.nats_url || l.nats, false);
  line("config:", l.config_path, true);
  if (l.lock_status) line("run.lock status:", l.lock_status, true);
  if (l.state === "exited" && l.outcome !== "finished") {
    line("continue it later (or press Run again with the same config):", l.continue_command, true);
  }
  document.getElementById("launch-tail").textContent = l.tail || "(no output yet)";
  if (l.outcome === "failed" && launchShownFailed !== l.started) {
    launchShownFailed = l.started;
    document.getElementById("launch-output").open = true;
  }
}

async function refreshLaunch() {
  clearTimeout(launchTimer);
  try {
    const d = await (await fetch("/api/launch")).json();
    renderLaunch(d.launch);
  } catch (e) {
    // the studio is gone or restarting: keep the last state, try again
  }
  launchTimer = setTimeout(refreshLaunch, LAUNCH_POLL_MS);
}

async function stopLaunch() {
  const message = document.getElementById("launch-message");
  message.textContent = "";
  try {
    const resp = await fetch("/api/launch/stop", {method: "POST"});
    const d = await resp.json();
    if (!d.ok) message.textContent = d.error;
    if (d.launch) renderLaunch(d.launch);
  } catch (e) {
    message.textContent = "/api/launch/stop: " + (e.message || e);
  }
  refreshLaunch();
}

refreshLaunch();
