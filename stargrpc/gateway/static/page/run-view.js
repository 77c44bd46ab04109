// The run shown: its title and state badge, steps (nested, with streamed output), the
// heartbeat, notices, the critic's countdown, Cancel and Steer, and its Result.

import { authHeaders } from "./api.js";
import { hideApproval, showApproval } from "./approval.js";
import { $, announce, el } from "./dom.js";
import { hideError, showRefusal } from "./errors.js";
import { base64Bytes, outcomeName, phaseName, statusName } from "./format.js";
import { showTool } from "./form.js";
import { renderResult } from "./result.js";
import { refreshRunState, resetRunStateView } from "./run-state.js";
import { refreshSessions } from "./sessions.js";
import { catalog, server, shown } from "./state.js";

// Empties the view for the run `shown` now names.
export function resetRunView() {
  const { runId, runArgs } = shown;
  $("run-arguments").hidden = runArgs === null;
  $("run-arguments-json").textContent = runArgs === null ? "" : JSON.stringify(runArgs, null, 2);
  hideError();
  $("run-view").hidden = false;
  $("run-title").textContent = "";
  $("run-id").textContent = runId;
  $("run-link").href = `#run=${runId}`;
  $("event-count").textContent = "0";
  $("steps").replaceChildren();
  $("notices").replaceChildren();
  hideApproval();
  $("heartbeat").hidden = true;
  $("queue-place").hidden = true;
  $("result").hidden = true;
  $("cancel-button").disabled = false;
  $("steer-form").hidden = !server.canSteer;
  resetRunStateView();
  setRunState("RUNNING");
}

export function setRunState(name) {
  const badge = $("run-state");
  badge.dataset.state = name;
  badge.textContent = name.toLowerCase();
}

export function showEventCount(seq) {
  $("event-count").textContent = String(seq);
}

// -- events, by kind --------------------------------------------------------------------------

function stepNode(id) {
  return $("steps").querySelector(`li[data-step-id="${CSS.escape(id)}"]`);
}

// A step event; `childRunId` is set on one a child run relayed (ctx.call): its step ids are
// prefixed with the path of run ids down to it, and its top-level step names the step of
// this run that called it as parent, so the child nests where it was called, live.
export function onStep(event, childRunId = "") {
  const step = event.step || {};
  const phase = phaseName(event.phase);
  let node = stepNode(step.id);
  if (phase === "START" || !node) {
    node = node || el("li", "step");
    node.dataset.stepId = step.id;
    const head = el("div", "step-head");
    head.append(el("span", "step-status"), el("span", "step-title", step.title || step.id),
                el("span", "step-kind", step.kind || ""), el("span", "step-time", ""));
    if (childRunId && step.id.endsWith(`${childRunId}/s0`)) {
      // The child run's own top-level step: say which run it is, and link to it.
      node.classList.add("child-run");
      node.dataset.childRunId = childRunId;
      const link = el("a", "child-run-link", `run ${childRunId.slice(0, 8)}…`);
      link.href = `#run=${childRunId}`;
      link.title = `child run ${childRunId}`;
      head.append(link);
    }
    node.replaceChildren(head, el("div", "step-summary", ""), el("pre", "step-output"),
                         el("ul", "steps children"));
    const parent = step.parent_id ? stepNode(step.parent_id) : null;
    (parent ? parent.querySelector(":scope > ul.children") : $("steps")).append(node);
    if (!step.parent_id) {
      showRunTool(step.title);
      if ($("run-state").dataset.state === "QUEUED") setRunState("RUNNING");
      $("queue-place").hidden = true;
    }
    setStepStatus(node, "RUNNING");
    if (step.parent_id) announce(`Step started: ${step.title || step.id}`);
  }
  if (phase === "DELTA") {
    const output = node.querySelector(":scope > pre.step-output");
    const piece = el("span", event.channel ? `channel-${event.channel}` : "", event.delta || "");
    output.append(piece);
    // A child's output is the child's: the run's own streamed output stays its own.
    if (event.channel !== "stderr" && !childRunId) shown.streamed += event.delta || "";
  } else if (phase === "END") {
    setStepStatus(node, statusName(step.status));
    node.querySelector(":scope > .step-summary").textContent = step.summary || "";
    if (step.started_at && step.ended_at) {
      const took = (Date.parse(step.ended_at) - Date.parse(step.started_at)) / 1000;
      node.querySelector(":scope > .step-head > .step-time").textContent = `${took.toFixed(2)} s`;
    }
  }
}

// The top-level step is the tool call: name the run after it and, when the run was
// re-joined from the URL, put its tool in the form.
function showRunTool(name) {
  if ($("run-title").textContent) return;
  $("run-title").textContent = name;
  if (catalog.has(name) && ($("tool").value !== name || shown.runArgs)) {
    $("tool").value = name;
    showTool(name, shown.runArgs || undefined);
  }
}

function setStepStatus(node, status) {
  node.dataset.status = status;
  node.querySelector(":scope > .step-head > .step-status").textContent =
    { RUNNING: "…", COMPLETE: "✓", ERROR: "✗" }[status] || status;
}

export function onHeartbeat(heartbeat) {
  $("heartbeat").hidden = false;
  $("heartbeat-message").textContent = heartbeat.message || "working";
  const bar = $("heartbeat-progress");
  if (heartbeat.progress !== undefined) bar.value = heartbeat.progress;
  else bar.removeAttribute("value");
}

export function onNotice(notice) {
  if (notice.code === "APPROVAL_REQUIRED" && notice.approval) {
    showApproval(shown.runId, notice.approval);
    setRunState("AWAITING");
  } else if (notice.code === "APPROVAL_GRANTED") {
    hideApproval();
    setRunState("RUNNING");
  } else if (notice.code === "QUEUED" && notice.queued) {
    showQueued(notice.queued);
    return;
  }
  const level = (notice.level || "").replace("NOTICE_LEVEL_", "").toLowerCase();
  const item = el("li", `notice ${level}`, `${notice.code || ""} ${notice.message || ""}`.trim());
  $("notices").append(item);
}

// A queued run: its state, and where it waits (updated with each QUEUED notice).
function showQueued(queued) {
  if (!shown.finished) setRunState("QUEUED");
  const place = $("queue-place");
  const wait = queued.estimated_wait ? parseFloat(queued.estimated_wait) : 0;
  place.textContent = `Waiting in lane ${queued.lane || "default"}: #${queued.position || "?"} in line`
    + (wait ? `, about ${wait < 60 ? `${wait.toFixed(1)} s` : `${Math.round(wait / 60)} min`}` : "")
    + (queued.priority ? ` (priority ${queued.priority})` : "");
  place.hidden = false;
}

export function onFileChunk(chunk) {
  const parts = shown.chunks.get(chunk.file_id) || [];
  parts.push(base64Bytes(chunk.data));
  shown.chunks.set(chunk.file_id, parts);
}

export function onResult(result) {
  shown.finished = true;
  shown.deadline = null;
  $("cancel-button").disabled = true;
  $("steer-form").hidden = true;
  $("heartbeat").hidden = true;
  hideApproval();
  $("queue-place").hidden = true;
  const outcome = outcomeName(result.outcome);
  setRunState(outcome);
  announce(`Run finished: ${outcome.toLowerCase()}`);
  renderResult(result, shown);
  refreshSessions();  // a run in a session may have changed its files
  refreshRunState();  // what the run kept, as it ended
}

// -- the critic's countdown -------------------------------------------------------------------

export function tick() {
  const node = $("time-left");
  if (shown.deadline === null || shown.finished) {
    node.hidden = true;
    return;
  }
  const left = Math.max(0, (shown.deadline - Date.now()) / 1000);
  node.hidden = false;
  node.dataset.seconds = left.toFixed(1);
  const quiet = shown.softTimeout || Math.ceil(left);
  node.textContent = `stops if nothing happens for ${quiet} s · ${Math.ceil(left)} s left`;
}

// -- Cancel and Steer -------------------------------------------------------------------------

export async function cancelRun() {
  if (!shown.runId) return;
  const response = await fetch(`/v1/runs/${shown.runId}:cancel`, {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ reason: "cancelled from the progress page" }),
  });
  if (!response.ok) await showRefusal("The run was not cancelled", response);
}

export async function steerRun(event) {
  event.preventDefault();
  const message = $("steer-message").value.trim();
  if (!shown.runId || !message) return;
  const response = await fetch(`/v1/runs/${shown.runId}:steer`, {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ message }),
  });
  if (!response.ok) await showRefusal("The message was not sent", response);
  else {
    $("steer-message").value = "";
    announce("Steering message sent");
  }
}
