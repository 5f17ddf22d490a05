// dcp-planner dashboard: the service's epoch jobs, their steps and pictures (no library, no CDN).
// Reads GET /v1/epochs, /v1/epochs/{id}/figures and the service's own SVG pictures; cancels and
// resumes jobs with POST /v1/epochs/{id}/cancel|resume. A token typed in the header (kept for the
// browser tab only) is sent as a Bearer token with every request, pictures included (they are
// fetched, then shown from blob URLs). The address keeps the selection: #epoch=ID&step=N.
// When the first views have loaded, <body data-status> is "ready" (or "error"), and data-images
// counts the pictures loaded (the browser test reads both).
"use strict";

const view = { epochs: [], epoch: null, step: null, images: 0, timer: null };

function $(id) { return document.getElementById(id); }

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fmtPct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(2) + "%"; }
function fmtX(x) { return x === null || x === undefined ? "-" : x.toFixed(2) + "x"; }
function fmtS(x) { return x === null || x === undefined ? "-" : (x >= 100 ? x.toFixed(1) : x.toFixed(3)); }
function fmtMs(x) { return x === null || x === undefined ? "-" : (1000 * x).toFixed(1); }
function fmtRate(x) {
  if (x === null || x === undefined || x <= 0) return "-";
  return x >= 1e6 ? (x / 1e6).toFixed(2) + "M" : x >= 1e3 ? (x / 1e3).toFixed(1) + "k" : x.toFixed(0);
}
function fmtEta(s) {
  if (s === null || s === undefined) return "-";
  return s < 90 ? Math.round(s) + " s" : Math.round(s / 60) + " min";
}

function authHeaders() {
  const token = sessionStorage.getItem("dcp-token");
  return token ? { Authorization: "Bearer " + token } : {};
}

async function request(url, method) {
  const response = await fetch(url, { method: method || "GET",
    headers: { Accept: "application/json", ...authHeaders() } });
  if (!response.ok) {
    let detail = "";
    try { detail = JSON.stringify((await response.json()).detail); } catch (e) { detail = ""; }
    throw new Error(url + " answered " + response.status + (detail ? ": " + detail : ""));
  }
  return response;
}

async function getJSON(url) { return (await request(url)).json(); }

async function loadImage(img, url) {
  // Fetched (so the token goes with it) and shown from a blob URL; the service's error says why
  // a picture is missing (e.g. 409: the epoch's cost model changed since it was planned).
  const blob = await (await request(url)).blob();
  const old = img.dataset.blob;
  await new Promise((resolve, reject) => {
    img.onload = () => { view.images += 1; document.body.dataset.images = String(view.images); resolve(); };
    img.onerror = () => reject(new Error(url + " is not a picture"));
    img.dataset.blob = URL.createObjectURL(blob);
    img.src = img.dataset.blob;
  });
  if (old) URL.revokeObjectURL(old);
}

function epochPath(id) { return "/v1/epochs/" + encodeURIComponent(id); }

function setAddress() {
  const parts = [];
  if (view.epoch !== null) parts.push("epoch=" + encodeURIComponent(view.epoch));
  if (view.step !== null) parts.push("step=" + view.step);
  history.replaceState(null, "", "#" + parts.join("&"));
}

function readAddress() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  const step = params.get("step");
  return { epoch: params.get("epoch"), step: step === null || step === "" ? null : Number(step) };
}

function actionButton(e) {
  const active = e.state === "queued" || e.state === "running";
  if (!active && e.state !== "failed" && e.state !== "cancelled") return null;
  const button = document.createElement("button");
  button.dataset.action = active ? "cancel" : "resume";
  button.textContent = active ? "cancel" : "resume";
  button.addEventListener("click", (ev) => {
    ev.stopPropagation();
    button.disabled = true;
    request(epochPath(e.epoch_id) + "/" + button.dataset.action, "POST")
      .then(() => refresh()).catch(showError).finally(() => { button.disabled = false; });
  });
  return button;
}

function renderEpochs() {
  const body = $("epochs").tBodies[0];
  body.replaceChildren();
  $("epochs-empty").hidden = view.epochs.length > 0;
  for (const e of view.epochs) {
    const tr = document.createElement("tr");
    tr.dataset.epoch = e.epoch_id;
    tr.dataset.state = e.state;
    if (view.epoch === e.epoch_id) tr.className = "selected";
    const stateText = e.state + (e.transient && e.state !== "done" ? " (retrying)" : "");
    tr.append(cell(e.epoch_id, "name"), cell(stateText, "name state-" + e.state));
    const bar = document.createElement("td");
    const outer = document.createElement("span");
    outer.className = "bar";
    outer.title = (100 * e.progress).toFixed(0) + "%";
    const inner = document.createElement("span");
    inner.style.width = (100 * e.progress).toFixed(1) + "%";
    outer.append(inner);
    bar.append(outer);
    const s = e.summary || {};
    tr.append(bar, cell(e.steps_done + "/" + e.steps_total), cell(fmtPct(s.mean_gap)),
      cell(fmtX(s.mean_predicted_speedup_vs_strongest)), cell(fmtX(s.mean_predicted_speedup_vs_bucket)),
      cell(e.state === "queued" || e.state === "running" ? fmtEta(e.eta_s) : "-"),
      cell(e.cluster_name, "name"), cell(e.cost_model_id, "name"));
    const actions = cell("", "name");
    const button = actionButton(e);
    if (button) actions.append(button);
    tr.append(actions);
    tr.addEventListener("click", () => selectEpoch(e.epoch_id, null).catch(showError));
    body.append(tr);
    if (e.error) {  // a failed (or retrying) job says why, under its row
      const row = document.createElement("tr");
      row.dataset.errorOf = e.epoch_id;
      const td = cell(e.error, "error-row");
      td.colSpan = 11;
      row.append(td);
      body.append(row);
    }
  }
}

function renderSteps(figures) {
  const body = $("steps").tBodies[0];
  body.replaceChildren();
  const select = $("step-select");
  select.replaceChildren();
  for (const f of figures) {
    const tr = document.createElement("tr");
    tr.dataset.step = String(f.step);
    const m = f.measured;
    tr.append(cell(String(f.step)), cell(fmtS(f.predicted_step_time_s)), cell(fmtS(f.lower_bound_s)),
      cell(fmtPct(f.gap)), cell(f.strongest_baseline || "-", "name"), cell(fmtX(f.speedups.strongest)),
      cell(fmtX(f.speedups["bucket-sp4"])), cell(f.status, "name"), cell(fmtMs(f.planning_wall_s)),
      cell(fmtRate(f.predicted_tokens_per_s)), cell(m ? m.mean_ratio.toFixed(3) : "-"),
      cell(m ? fmtPct(m.mape) : "-"));
    tr.addEventListener("click", () => selectStep(f.step).catch(showError));
    body.append(tr);
    const option = document.createElement("option");
    option.value = String(f.step);
    option.textContent = String(f.step);
    select.append(option);
  }
}

async function selectStep(step) {
  view.step = step;
  setAddress();
  $("step-select").value = String(step);
  for (const tr of $("steps").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.step === String(step));
  const base = epochPath(view.epoch) + "/steps/" + step;
  $("trace-link").href = base + "/trace.json";
  await Promise.all([loadImage($("gantt"), base + "/gantt.svg"), loadImage($("memory"), base + "/memory.svg")]);
}

async function selectEpoch(id, step) {
  const epoch = view.epochs.find((e) => e.epoch_id === id);
  if (!epoch) throw new Error("no epoch " + id + " on this service");
  view.epoch = id;
  renderEpochs();
  $("epoch").hidden = false;
  $("epoch-title").textContent = "Epoch " + id + " (" + epoch.state + ", " + epoch.steps_done + "/" +
    epoch.steps_total + " steps)";
  $("epoch-error").hidden = !epoch.error;
  $("epoch-error").textContent = epoch.error ? epoch.state + ": " + epoch.error : "";
  $("epoch-html").href = epochPath(id) + "/report.html";
  const figures = await getJSON(epochPath(id) + "/figures");
  renderSteps(figures);
  if (figures.length === 0) {
    for (const img of ["epoch-chart", "gantt", "memory"]) $(img).removeAttribute("src");
    view.step = null;
    setAddress();
    return;
  }
  const loads = [loadImage($("epoch-chart"), epochPath(id) + "/report.svg?steps=" + epoch.steps_done)];
  const wanted = step !== null && step !== undefined ? step : view.step;
  const keep = figures.some((f) => f.step === wanted) ? wanted : figures[0].step;
  loads.push(selectStep(keep));
  await Promise.all(loads);
}

async function refresh() {
  const before = view.epochs.find((e) => e.epoch_id === view.epoch);
  view.epochs = await getJSON("/v1/epochs");
  renderEpochs();
  const now = view.epochs.find((e) => e.epoch_id === view.epoch);
  if (before && now && (now.steps_done !== before.steps_done || now.state !== before.state)) {
    await selectEpoch(now.epoch_id, view.step);
  }
  const active = view.epochs.some((e) => e.state === "queued" || e.state === "running");
  if (active && view.timer === null) view.timer = setInterval(() => refresh().catch(showError), 5000);
  if (!active && view.timer !== null) { clearInterval(view.timer); view.timer = null; }
}

function showError(error) {
  $("error").hidden = false;
  $("error").textContent = String(error);
  document.body.dataset.status = "error";
}

async function main() {
  $("token").value = sessionStorage.getItem("dcp-token") || "";
  $("token").addEventListener("change", (ev) => {
    sessionStorage.setItem("dcp-token", ev.target.value.trim());
    refresh().catch(showError);
  });
  $("step-select").addEventListener("change", (ev) => selectStep(Number(ev.target.value)).catch(showError));
  await refresh();
  const wanted = readAddress();
  if (wanted.epoch !== null) await selectEpoch(wanted.epoch, wanted.step);
  else if (view.epochs.length > 0) await selectEpoch(view.epochs[view.epochs.length - 1].epoch_id, null);
  document.body.dataset.status = "ready";
}

main().catch(showError);
