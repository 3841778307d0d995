// rftstream studio: the config form, generated from /api/schema (the msgspec config schema).
"use strict";

const FIELDS = [];  // {path, kind, optional, input}

function defaultText(f) {
  if (f.default === null || f.default === undefined) return "";
  if (f.kind === "yaml") return JSON.stringify(f.default);  // JSON is YAML
  return String(f.default);
}

function makeInput(f) {
  let input;
  if (f.kind === "bool") {
    input = document.createElement("input");
    input.type = "checkbox";
    input.checked = Boolean(f.default);
  } else if (f.choices.length) {
    input = document.createElement("select");
    for (const c of f.choices) {
      const o = document.createElement("option");
      o.value = c;
      o.textContent = c === "" ? "(default)" : c;
      input.appendChild(o);
    }
    input.value = f.default === null ? "" : String(f.default);
  } else if (f.kind === "yaml") {
    input = document.createElement("textarea");
    input.value = defaultText(f);
    input.rows = Math.min(8, Math.max(1, input.value.split("\n").length));
  } else {
    input = document.createElement("input");
    input.type = "text";
    input.value = defaultText(f);
    if (f.suggestions.length) {
      const list = document.createElement("datalist");
      list.id = "dl-" + f.path;
      for (const s of f.suggestions) {
        const o = document.createElement("option");
        o.value = s;
        list.appendChild(o);
      }
      document.body.appendChild(list);
      input.setAttribute("list", list.id);
    }
  }
  input.name = f.path;
  input.id = "f-" + f.path;
  return input;
}

function makeField(f) {
  const row = document.createElement("div");
  row.className = "field";
  row.dataset.path = f.path;
  const label = document.createElement("label");
  label.htmlFor = "f-" + f.path;
  label.textContent = f.path + (f.optional ? " (optional)" : "");
  label.title = f.kind + (f.kind === "yaml" ? ": YAML (or JSON) text" : "");
  const input = makeInput(f);
  const err = document.createElement("div");
  err.className = "error";
  row.append(label, input, err);
  FIELDS.push({path: f.path, kind: f.kind, input: input});
  return row;
}

// a section's docstring: [kind, text] runs ("text" or "code") as DOM nodes (never HTML)
function helpText(parts) {
  const p = document.createElement("p");
  p.className = "section-help";
  for (const [kind, text] of parts) {
    if (kind === "code") {
      const c = document.createElement("code");
      c.textContent = text;
      p.appendChild(c);
    } else {
      p.appendChild(document.createTextNode(text));
    }
  }
  return p;
}

function render(sections) {
  const root = document.getElementById("sections");
  root.textContent = "";
  for (const s of sections) {
    const fs = document.createElement("fieldset");
    fs.id = "section-" + s.key;
    const legend = document.createElement("legend");
    legend.textContent = s.title;
    fs.appendChild(legend);
    if (s.help_parts && s.help_parts.length) fs.appendChild(helpText(s.help_parts));
    const advanced = document.createElement("details");
    advanced.className = "advanced";
    const summary = document.createElement("summary");
    let n = 0;
    for (const f of s.fields) {
      if (f.common) fs.appendChild(makeField(f));
      else { advanced.appendChild(makeField(f)); n += 1; }
    }
    if (n) {
      summary.textContent = `advanced (${n} keys)`;
      advanced.prepend(summary);
      fs.appendChild(advanced);
    }
    root.appendChild(fs);
  }
}

function values() {
  const out = {};
  for (const f of FIELDS) out[f.path] = f.kind === "bool" ? f.input.checked : f.input.value;
  return out;
}

function clearErrors() {
  for (const row of document.querySelectorAll(".field.has-error")) {
    row.classList.remove("has-error");
    row.querySelector(".error").textContent = "";
  }
  for (const id of ["general-errors", "warnings", "save-error", "saved", "launch-error"]) {
    document.getElementById(id).textContent = "";
  }
}

function show(result) {
  clearErrors();
  const paths = Object.keys(result.errors || {});
  for (const path of paths) {
    const row = document.querySelector(`.field[data-path="${CSS.escape(path)}"]`);
    if (!row) { (result.general = result.general || []).push(path + ": " + result.errors[path]); continue; }
    row.classList.add("has-error");
    row.querySelector(".error").textContent = result.errors[path];
    const details = row.closest("details");
    if (details) details.open = true;
  }
  if (paths.length) {
    const first = document.querySelector(".field.has-error");
    if (first) first.scrollIntoView({block: "center"});
  }
  document.getElementById("general-errors").textContent = (result.general || []).join("\n");
  document.getElementById("warnings").textContent =
    (result.warnings || []).map((w) => "warning: " + w).join("\n");
  const n = paths.length + (result.general || []).length;
  document.getElementById("status").textContent =
    result.ok ? "valid" : `${n} error${n === 1 ? "" : "s"}`;
  const pre = document.getElementById("yaml");
  pre.textContent = result.yaml || "(no YAML: fix the errors above)";
  const link = document.getElementById("download");
  if (result.ok) {
    link.href = "data:text/yaml;charset=utf-8," + encodeURIComponent(result.yaml);
    link.style.display = "";
  } else {
    link.style.display = "none";
  }
}

async function post(url, body) {
  document.getElementById("status").textContent = "checking…";
  const resp = await fetch(url, {
    method: "POST",
    headers: {"Content-Type": "application/json"},
    body: JSON.stringify(body),
  });
  if (!resp.ok) {
    clearErrors();
    document.getElementById("status").textContent = "error";
    document.getElementById("general-errors").textContent = `${url}: ${resp.status} ${await resp.text()}`;
    return null;
  }
  return resp.json();
}

document.getElementById("check").addEventListener("click", async () => {
  const result = await post("/api/config", {values: values()});
  if (result) show(result);
});

document.getElementById("save").addEventListener("click", async () => {
  const path = document.getElementById("save-path").value;
  const result = await post("/api/save", {values: values(), path: path});
  if (!result) return;
  show(result);
  if (result.save_error) document.getElementById("save-error").textContent = result.save_error;
  if (result.saved) document.getElementById("saved").textContent = "saved " + result.saved;
});

// Run: the same check, then `rftstream up` on the checked config (POST /api/launch); on
// success the page becomes the run's live view, else it shows why (field errors, a run
// already running, a run dir held by another `up`)
document.getElementById("run").addEventListener("click", async () => {
  const status = document.getElementById("status");
  const button = document.getElementById("run");
  status.textContent = "checking and starting…";
  button.disabled = true;
  let result;
  try {
    const resp = await fetch("/api/launch", {
      method: "POST",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify({values: values(), fresh: document.getElementById("fresh").checked}),
    });
    const text = await resp.text();
    try { result = JSON.parse(text); } catch (e) { result = {ok: false, error: `${resp.status} ${text}`}; }
  } catch (e) {
    result = {ok: false, error: String(e.message || e)};
  } finally {
    button.disabled = false;
  }
  if ("errors" in result) show(result);
  else clearErrors();
  if (result.ok && result.launch) {
    status.textContent = "started";
    location.href = result.launch.live_url;
    return;
  }
  if (result.error) {
    status.textContent = "not started";
    document.getElementById("launch-error").textContent = "Run: " + result.error;
  }
  if (result.launch) renderLaunch(result.launch);
});

fetch("/api/schema")
  .then((r) => r.json())
  .then((data) => { render(data.sections); document.body.dataset.ready = "1"; })
  .catch((e) => { document.getElementById("sections").textContent = "cannot load the schema: " + e; });
