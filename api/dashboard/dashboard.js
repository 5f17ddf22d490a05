// dcp-planner dashboard: read-only views of the service's epoch jobs (no library, no CDN).
// Reads GET /v1/epochs, /v1/epochs/{id}/figures; shows the service's own SVG pictures.
// When the first views have loaded, <body data-status> is "ready" (or "error"), and
// data-images counts the pictures loaded (the browser test reads both).
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
function fmtEta(s) {
  if (s === null || s === undefined) return "-";
  return s < 90 ? Math.round(s) + " s" : Math.round(s / 60) + " min";
}

async function getJSON(url) {
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(url + " answered " + response.status);
  return response.json();
}

function loadImage(img, url) {
  return new Promise((resolve, reject) => {
    img.onload = () => { view.images += 1; document.body.dataset.images = String(view.images); resolve(); };
    img.onerror = () => {
      // The service says why (e.g. 409: the epoch's cost model changed since it was planned).
      fetch(url).then((r) => r.json()).then((d) => reject(new Error(url + ": " + d.detail)),
        () => reject(new Error(url + " did not load")));
    };
    img.src = url;
  });
}

function epochPath(id) { return "/v1/epochs/" + encodeURIComponent(id); }

function renderEpochs() {
  const body = $("epochs").tBodies[0];
  body.replaceChildren();
  $("epochs-empty").hidden = view.epochs.length > 0;
  for (const e of view.epochs) {
    const tr = document.createElement("tr");
    tr.dataset.epoch = e.epoch_id;
    if (view.epoch === e.epoch_id) tr.className = "selected";
    tr.append(cell(e.epoch_id, "name"), cell(e.state, "name state-" + e.state));
    const bar = document.createElement("td");
    const outer = document.createElement("span");
    outer.className = "bar";
    outer.title = (100 * e.progress).toFixed(0) + "%";
    const inner = document.createElement("span");
    inner.style.width = (100 * e.progress).toFixed(1) + "%";
    outer.append(inner);
    bar.append(outer);
    tr.append(bar, cell(e.steps_done + "/" + e.steps_total), cell(fmtPct(e.summary.mean_gap)),
      cell(fmtX(e.summary.mean_predicted_speedup_vs_bucket)),
      cell(e.state === "queued" || e.state === "running" ? fmtEta(e.eta_s) : "-"),
      cell(e.cluster_name, "name"), cell(e.cost_model_id, "name"));
    tr.addEventListener("click", () => selectEpoch(e.epoch_id));
    body.append(tr);
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
    tr.append(cell(String(f.step)), cell(fmtS(f.predicted_step_time_s)), cell(fmtS(f.lower_bound_s)),
      cell(fmtPct(f.gap)), cell(f.strongest_baseline || "-", "name"), cell(fmtX(f.speedups.strongest)),
      cell(fmtX(f.speedups["bucket-sp4"])), cell(f.status, "name"));
    tr.addEventListener("click", () => selectStep(f.step));
    body.append(tr);
    const option = document.createElement("option");
    option.value = String(f.step);
    option.textContent = String(f.step);
    select.append(option);
  }
}

async function selectStep(step) {
  view.step = step;
  $("step-select").value = String(step);
  for (const tr of $("steps").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.step === String(step));
  await loadImage($("gantt"), epochPath(view.epoch) + "/steps/" + step + "/gantt.svg");
}

async function selectEpoch(id) {
  view.epoch = id;
  renderEpochs();
  const epoch = view.epochs.find((e) => e.epoch_id === id);
  $("epoch").hidden = false;
  $("epoch-title").textContent = "Epoch " + id + " (" + epoch.state + ", " + epoch.steps_done + "/" +
    epoch.steps_total + " steps)";
  $("epoch-html").href = epochPath(id) + "/report.html";
  const figures = await getJSON(epochPath(id) + "/figures");
  renderSteps(figures);
  if (figures.length === 0) {
    $("epoch-chart").removeAttribute("src");
    $("gantt").removeAttribute("src");
    return;
  }
  const loads = [loadImage($("epoch-chart"), epochPath(id) + "/report.svg?steps=" + epoch.steps_done)];
  const keep = figures.some((f) => f.step === view.step) ? view.step : figures[0].step;
  loads.push(selectStep(keep));
  await Promise.all(loads);
}

async function refresh() {
  const before = view.epochs.find((e) => e.epoch_id === view.epoch);
  view.epochs = await getJSON("/v1/epochs");
  renderEpochs();
  const now = view.epochs.find((e) => e.epoch_id === view.epoch);
  if (before && now && now.steps_done !== before.steps_done) await selectEpoch(now.epoch_id);
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
  $("step-select").addEventListener("change", (ev) => selectStep(Number(ev.target.value)).catch(showError));
  await refresh();
  if (view.epochs.length > 0) await selectEpoch(view.epochs[view.epochs.length - 1].epoch_id);
  document.body.dataset.status = "ready";
}

main().catch(showError);
