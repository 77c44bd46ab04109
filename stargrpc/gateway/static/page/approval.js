// A run that waits for a person's approval: what it would run (the tool, who asked, the
// arguments as the audit shows them, their sha256) and Approve / Deny, which decide with
// POST /v1/runs/{id}:approve bound to that digest. Shown in the run view (from its
// APPROVAL_REQUIRED notice) and under each waiting run of the runs list.

import { authHeaders } from "./api.js";
import { $, announce, el } from "./dom.js";
import { showRefusal } from "./errors.js";

// Boxes made so far: each box's reason field gets an id of its own (a run may show twice,
// in the run view and in the list).
let boxes = 0;

function prettyArguments(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text || "";
  }
}

async function decide(runId, request, decision, reason, box) {
  for (const button of box.querySelectorAll("button")) button.disabled = true;
  const response = await fetch(`/v1/runs/${encodeURIComponent(runId)}:approve`, {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ approval_id: request.approval_id, decision, reason,
                           arguments_digest: request.arguments_digest }),
  });
  if (!response.ok) {
    await showRefusal(decision === "approve" ? "The run was not approved"
                                             : "The run was not denied", response);
    for (const button of box.querySelectorAll("button")) button.disabled = false;
    return;
  }
  box.dataset.decided = decision;
  box.querySelector(".approval-status").textContent =
    decision === "approve" ? "Approved." : "Denied.";
  announce(decision === "approve" ? "Run approved" : "Run denied");
}

// The box for run `runId` waiting on `request` (an ApprovalRequest as JSON).
export function approvalBox(runId, request) {
  const box = el("div", "approval-box");
  box.setAttribute("role", "group");
  box.setAttribute("aria-label", `Approval of ${request.tool_name || "the run"}`);
  const deadline = request.deadline ? new Date(request.deadline).toLocaleTimeString() : "";
  box.append(el("p", "approval-what",
                `${request.principal || "someone"} asks to run ${request.tool_name || "a tool"}` +
                (deadline ? ` (waits until ${deadline})` : "")));
  box.append(el("pre", "approval-arguments", prettyArguments(request.arguments)));
  const digest = el("p", "help");
  digest.append("arguments sha256 ", el("code", "", request.arguments_digest || ""));
  box.append(digest);
  boxes += 1;
  const reasonId = `approval-reason-${boxes}`;
  const label = el("label", "", "Reason");
  label.htmlFor = reasonId;
  const reason = el("input");
  reason.type = "text";
  reason.id = reasonId;
  reason.maxLength = 1000;
  const row = el("div", "row");
  const approve = el("button", "approve-button", "Approve");
  approve.type = "button";
  const deny = el("button", "deny-button secondary", "Deny");
  deny.type = "button";
  approve.addEventListener("click", () => decide(runId, request, "approve", reason.value, box));
  deny.addEventListener("click", () => decide(runId, request, "deny", reason.value, box));
  row.append(approve, deny);
  box.append(label, reason, row, el("p", "approval-status help"));
  return box;
}

// The run view's box: shown for an APPROVAL_REQUIRED notice, gone once decided or ended.
export function showApproval(runId, request) {
  $("approval").replaceChildren(approvalBox(runId, request));
  $("approval").hidden = false;
}

export function hideApproval() {
  $("approval").hidden = true;
  $("approval").replaceChildren();
}
