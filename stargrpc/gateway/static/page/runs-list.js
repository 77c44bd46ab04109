// The runs list beside the run: the caller's runs, live over GET /v1/runs/events, filtered
// by tool and outcome; a click opens one. The runs of a call tree fold into their root
// (when the root is in the list): a disclosure under it opens them, indented by depth.

import { authHeaders } from "./api.js";
import { approvalBox } from "./approval.js";
import { $, el } from "./dom.js";
import { outcomeName } from "./format.js";
import { readEvents } from "./sse.js";
import { shown } from "./state.js";

// The open watch, and what a click on a run does (given by initRunsList).
const watch = { abort: null, open: () => {} };

// The roots whose folded tree is open: kept across the list's live re-renders.
const openTrees = new Set();

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
  if (["running", "queued", "awaiting_approval"].includes(outcome)) params.set("state", outcome);
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
  const listed = new Set(runs.map((run) => run.run_id));
  const below = new Map();  // root run id -> the runs of its tree in the list
  for (const run of runs) {
    const root = run.root_run_id;
    if (run.depth > 0 && root && listed.has(root)) {
      if (!below.has(root)) below.set(root, []);
      below.get(root).push(run);
    }
  }
  for (const run of runs) {
    if (run.depth > 0 && listed.has(run.root_run_id)) continue;  // folded into its root
    const item = runItem(run);
    const tree = below.get(run.run_id);
    if (tree) {
      const fold = el("details", "run-tree");
      fold.open = openTrees.has(run.run_id);
      fold.addEventListener("toggle", () => {
        if (fold.open) openTrees.add(run.run_id);
        else openTrees.delete(run.run_id);
      });
      fold.append(el("summary", "run-tree-summary",
                     `${tree.length} run${tree.length === 1 ? "" : "s"} below`));
      const nested = el("ul", "runs nested");
      for (const child of depthFirst(run.run_id, tree)) {
        const childItem = runItem(child);
        childItem.style.marginInlineStart = `${Math.min(child.depth, 8)}em`;
        nested.append(childItem);
      }
      fold.append(nested);
      item.append(fold);
    }
    list.append(item);
  }
}

// The runs of a tree below `rootId`, each followed by the runs it started (oldest first);
// a run whose parent is not in the list comes after the rest.
function depthFirst(rootId, tree) {
  const byParent = new Map();
  for (const run of [...tree].sort((a, b) => a.started_at.localeCompare(b.started_at))) {
    if (!byParent.has(run.parent_run_id)) byParent.set(run.parent_run_id, []);
    byParent.get(run.parent_run_id).push(run);
  }
  const ordered = [];
  const visit = (parentId) => {
    for (const run of byParent.get(parentId) || []) {
      ordered.push(run);
      visit(run.run_id);
    }
  };
  visit(rootId);
  const placed = new Set(ordered.map((run) => run.run_id));
  return [...ordered, ...tree.filter((run) => !placed.has(run.run_id))];
}

// One run of the list, as a list item holding its button.
function runItem(run) {
  const running = run.state === "RUN_STATE_RUNNING";
  const awaiting = run.state === "RUN_STATE_AWAITING_APPROVAL";
  const queued = run.state === "RUN_STATE_QUEUED";
  const status = running ? "RUNNING" : awaiting ? "AWAITING" : queued ? "QUEUED"
    : outcomeName(run.outcome);
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
  // A waiting run's request and Approve / Deny (for an approver, anyone's).
  if (awaiting && run.approval) item.append(approvalBox(run.run_id, run.approval));
  return item;
}
