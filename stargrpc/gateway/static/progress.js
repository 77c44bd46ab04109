// The stargrpc live progress page: start a run, watch its steps, deltas, the critic's
// countdown and its Result, and re-join it after a reload (the run id is in the URL).
//
// This module only wires the page together; each part is a module under page/:
//   form.js       the run form: tool list, arguments form from the JSON Schema, JSON view
//   fields.js     the form's fields, one builder per kind of schema (schema.js reads it)
//   stream.js     following a run: its event stream, Last-Event-ID re-joins (sse.js parses)
//   run-view.js   the run shown: steps, heartbeat, notices, countdown, Cancel, Steer
//   approval.js   a run waiting for approval: its arguments, Approve and Deny
//   result.js     its Result; messages.js the rich messages (markdown.js, tree.js)
//   runs-list.js  the runs list, live, with its filters
//   sessions.js   the session picker (python, shell) and the session's files
//   run-state.js  the run and tree state of the run shown, for an admin viewer
//   state.js      what the parts share: the catalog, the server's offers, the run shown
// Events are read with fetch() rather than EventSource so that credentials can travel in
// an Authorization header.

import { savedToken, saveToken } from "./page/api.js";
import { $ } from "./page/dom.js";
import { hideError, showError } from "./page/errors.js";
import { currentArguments, loadTools, setView, showTool } from "./page/form.js";
import { cancelRun, steerRun, tick } from "./page/run-view.js";
import { refreshRunState } from "./page/run-state.js";
import { initRunsList, watchRuns } from "./page/runs-list.js";
import { newSession, refreshSessions, showSessionsFor } from "./page/sessions.js";
import { server, shown } from "./page/state.js";
import { follow, startRun } from "./page/stream.js";

// Lists the tools, then (when the server answered) the runs.
async function refreshTools() {
  if (await loadTools()) {
    watchRuns();
    showSessionsFor($("tool").value);
  }
}

async function submit(event) {
  event.preventDefault();
  hideError();
  if (!$("tool").value) {
    // Enter pressed in the key field before the tools were listed: there is nothing to
    // run yet, and the key is what the list was waiting for.
    await refreshTools();
    return;
  }
  let args;
  try {
    args = currentArguments();
  } catch (error) {
    showError(`The arguments are not valid: ${error.message}`);
    return;
  }
  await startRun($("tool").value, args);
}

function runFromUrl() {
  const match = /^#run=([A-Za-z0-9_-]+)$/.exec(location.hash);
  if (match && match[1] !== shown.runId) follow(match[1]);
}

// A module script runs once the document is parsed, as a deferred script did.
$("token").value = savedToken();
// Nothing works without a key on most servers: show where it goes until one is given.
$("credentials").open = !$("token").value;
$("token").addEventListener("change", () => {
  saveToken($("token").value.trim());
  refreshTools();
  refreshRunState();  // another key may read (or no longer read) the run's state
});
$("tool").addEventListener("change", () => {
  shown.runArgs = null;
  showTool($("tool").value);
  showSessionsFor($("tool").value);
});
$("session").addEventListener("change", refreshSessions);
$("new-session").addEventListener("click", newSession);
$("run-form").addEventListener("submit", submit);
$("cancel-button").addEventListener("click", cancelRun);
$("state-refresh").addEventListener("click", refreshRunState);
$("steer-form").addEventListener("submit", steerRun);
$("view-form").addEventListener("click", () => setView("form"));
$("view-json").addEventListener("click", () => setView("json"));
initRunsList(follow);
$("run-title").tabIndex = -1;
fetch("/v1/capabilities").then((r) => (r.ok ? r.json() : {})).then((caps) => {
  server.canSteer = !!caps.steer;
  $("steer-form").hidden = !server.canSteer || !shown.runId || shown.finished;
}).catch(() => {});
window.addEventListener("hashchange", runFromUrl);
window.addEventListener("popstate", runFromUrl);
setInterval(tick, 200);
refreshTools();
runFromUrl();
