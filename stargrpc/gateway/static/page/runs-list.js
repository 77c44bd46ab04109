// The runs list beside the run: the caller's runs, live over GET /v1/runs/events, filtered
// by tool and outcome; a click opens one.

import { authHeaders } from "./api.js";
import { $, el } from "./dom.js";
import { outcomeName } from "./format.js";
import { readEvents } from "./sse.js";
import { shown } from "./state.js";

// The open watch, and what a click on a run does (given by initRunsList).
const watch = { abort: null, open: () => {} };

// Wires the filters; `open(runId)` is called when a run is clicked.
export function initRunsList(open) {
  watch.open = open;
  $("filter-tool").addEventListener("change", () => watchRuns());
  $("filter-outcome").addEventListener("change", () => watchRuns());
}

function runsQuery() {
  const params = new URLSearchParams({ page_size: "30" });
  if ($("filter-tool").value) params.set("tool", $("filter-tool").value);
  const outcome = $("filter-outcome").value;
  if (outcome === "running" || outcome === "queued") params.set("state", outcome);
  else if (outcome) params.set("outcome", outcome);
  return params.toString();
}

// (Re)opens the watch with the filters shown.
export async function watchRuns() {
  if (watch.abort) watch.abort.abort();
  const abort = new AbortController();
  watch.abort = abort;
  const headers = authHeaders({ Accept: "text/event-stream" });
  for (let attempt = 0; attempt < 1000 && !abort.signal.aborted; attempt += 1) {
    try {
      const response = await fetch(`/v1/runs/events?${runsQuery()}`,
                                   { headers, signal: abort.signal });
      if (!response.ok) {
        $("runs-status").textContent = response.status === 401
          ? "Paste an API key under Credentials to see your runs." : `HTTP ${response.status}`;
        return;
      }
      await readEvents(response.body, (kind, data) => {
        if (kind === "runs") renderRuns(JSON.parse(data).runs || []);
      }, () => abort.signal.aborted);
    } catch {
      if (abort.signal.aborted) return;
    }
    await new Promise((resolve) => { setTimeout(resolve, Math.min(1000 * 2 ** attempt, 15000)); });
  }
}

// Marks the run shown in the list.
export function markCurrent(runId) {
  for (const button of $("runs-list").querySelectorAll("button.run-item")) {
    if (button.dataset.runId === runId) button.setAttribute("aria-current", "true");
    else button.removeAttribute("aria-current");
  }
}

function duration(run) {
  const start = Date.parse(run.started_at);
  const end = run.ended_at ? Date.parse(run.ended_at) : Date.now();
  const secs = Math.max(0, (end - start) / 1000);
  return secs < 60 ? `${secs.toFixed(1)} s` : `${Math.floor(secs / 60)} min ${Math.round(secs % 60)} s`;
}

function renderRuns(runs) {
  const list = $("runs-list");
  list.replaceChildren();
  $("runs-status").textContent = runs.length ? "" : "No runs yet.";
  for (const run of runs) {
    const running = run.state === "RUN_STATE_RUNNING";
    const queued = run.state === "RUN_STATE_QUEUED";
    const status = running ? "RUNNING" : queued ? "QUEUED" : outcomeName(run.outcome);
    const button = el("button", "run-item");
    button.type = "button";
    button.dataset.runId = run.run_id;
    if (run.run_id === shown.runId) button.setAttribute("aria-current", "true");
    const line = el("span", "run-line");
    const badge = el("span", "badge", status.toLowerCase());
    badge.dataset.state = status;
    line.append(el("span", "run-tool", run.tool_name), badge);
    const meta = [new Date(run.started_at).toLocaleTimeString(), duration(run)];
    if (run.principal) meta.push(run.principal);
    if (running && run.current_step) meta.push(run.current_step);
    if (queued) meta.push(`lane ${run.lane || "default"}, #${run.queue_position || "?"} in line`);
    button.append(line, el("span", "run-meta", meta.join(" · ")));
    button.setAttribute("aria-label",
      `${run.tool_name}, ${status.toLowerCase()}, started ${meta[0]}, ${meta[1]}`);
    button.addEventListener("click", () => {
      history.pushState(null, "", `#run=${run.run_id}`);
      watch.open(run.run_id);
      $("run-title").focus();
    });
    const item = el("li");
    item.append(button);
    list.append(item);
  }
}
