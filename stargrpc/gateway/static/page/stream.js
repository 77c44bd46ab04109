// Following a run's events: start a run, open its stream, hand each event to the run view,
// and re-join after a dropped stream. Like EventSource, the page then asks again with
// Last-Event-ID set to the last seq it saw, and the gateway replays exactly the events
// after it.

import { authHeaders, errorMessage, saveRunArgs, savedRunArgs } from "./api.js";
import { $ } from "./dom.js";
import { showError, showRefusal } from "./errors.js";
import { seconds } from "./format.js";
import { noteRootRun } from "./run-state.js";
import { markCurrent } from "./runs-list.js";
import {
  onFileChunk, onHeartbeat, onNotice, onResult, onStep, resetRunView, setRunState,
  showEventCount,
} from "./run-view.js";
import { selectedSession } from "./sessions.js";
import { readEvents } from "./sse.js";
import { showRun, shown } from "./state.js";

const MAX_RECONNECT_DELAY_MS = 15000;

// The stream of the run shown (only this module reads or writes it).
const stream = {
  lastSeq: 0,     // the newest seq rendered
  retryMs: 1000,  // reconnection delay, from the server's "retry:" field
  failures: 0,    // consecutive failed connections
  abort: null,    // AbortController of the open stream
};

function setConnection(text, stateName) {
  const node = $("connection");
  node.textContent = text;
  node.dataset.state = stateName;
}

// Starts `tool`; on success the run id goes into the URL and the page follows the run.
// The execute body, with the session picked (when one is) for the run to go to.
function withSession(body) {
  const sessionId = selectedSession();
  return sessionId ? { ...body, session_id: sessionId } : body;
}

export async function startRun(tool, args) {
  const response = await fetch(`/v1/tools/${encodeURIComponent(tool)}:execute`, {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify(withSession({ arguments: args })),
  });
  if (response.status !== 202) {
    // The previous run's panel goes away: the refusal is about this call, not that run.
    if (stream.abort) stream.abort.abort();
    shown.runId = null;
    $("run-view").hidden = true;
    history.replaceState(null, "", location.pathname);
    await showRefusal(`${tool} was not started`, response);
    return;
  }
  const body = await response.json();
  saveRunArgs(body.run_id, args);
  // A reload (or the link) re-joins the run.
  history.pushState(null, "", `#run=${body.run_id}`);
  follow(body.run_id);
}

// Shows a run from its first event, live.
export function follow(runId) {
  if (stream.abort) stream.abort.abort();
  Object.assign(stream, { lastSeq: 0, failures: 0 });
  showRun(runId, savedRunArgs(runId));
  resetRunView();
  markCurrent(runId);
  connect(runId);
}

async function connect(runId) {
  const abort = new AbortController();
  stream.abort = abort;
  const headers = authHeaders({ Accept: "text/event-stream" });
  if (stream.lastSeq > 0) headers["Last-Event-ID"] = String(stream.lastSeq);
  setConnection(stream.lastSeq > 0 ? "re-joining" : "connecting", "connecting");
  try {
    const response = await fetch(`/v1/runs/${runId}/events`, { headers, signal: abort.signal });
    if (response.status === 204) {
      setConnection("finished", "closed");
      return;
    }
    if (!response.ok) {
      const message = await errorMessage(response);
      setConnection("refused", "error");
      setRunState(response.status === 404 ? "GONE" : "ERROR");
      showError(response.status === 404
        ? `Run ${runId} is unknown here (it may have expired, or belong to another key): ${message}`
        : message, [], response.status === 401 ? "Paste an API key under Credentials above." : "");
      return;
    }
    setConnection("live", "live");
    stream.failures = 0;
    await readEvents(response.body, dispatch, () => shown.runId !== runId,
                     (ms) => { stream.retryMs = ms; });
  } catch {
    if (abort.signal.aborted) return;
  }
  if (shown.runId !== runId || shown.finished || abort.signal.aborted) {
    if (shown.finished) setConnection("finished", "closed");
    return;
  }
  // The stream ended before the Result: reconnect and resume after the last seq.
  stream.failures += 1;
  const delay = Math.min(stream.retryMs * 2 ** (stream.failures - 1), MAX_RECONNECT_DELAY_MS);
  setConnection(`reconnecting in ${(delay / 1000).toFixed(1)} s`, "connecting");
  setTimeout(() => { if (shown.runId === runId && !shown.finished) connect(runId); }, delay);
}

function dispatch(kind, data) {
  const payload = JSON.parse(data);
  if (kind === "error") {
    showError(`${payload.error.status}: ${payload.error.message}`);
    return;
  }
  const seq = Number(payload.seq || 0);
  if (seq <= stream.lastSeq) return;  // already shown (a replay overlapping a reconnect)
  stream.lastSeq = seq;
  showEventCount(seq);
  if (payload.critic_time_left !== undefined) {
    // Counted from the event's own time, so a replayed event (after a reload) does not
    // restart the countdown.
    const stamped = payload.time ? Date.parse(payload.time) : Date.now();
    shown.deadline = stamped + seconds(payload.critic_time_left) * 1000;
    if (shown.softTimeout === null) shown.softTimeout = Math.round(seconds(payload.critic_time_left));
  }
  noteRootRun(payload.root_run_id);  // on the run's first event: its state can be read
  if (payload.step) onStep(payload.step, payload.child_run_id || "");
  else if (payload.heartbeat) onHeartbeat(payload.heartbeat);
  else if (payload.notice) onNotice(payload.notice);
  else if (payload.file_chunk) onFileChunk(payload.file_chunk);
  else if (payload.result) onResult(payload.result);
}
