// The stargrpc live progress page: start a run, watch its steps, deltas, the critic's
// countdown and its Result, and re-join it after a reload (the run id is in the URL).
//
// Events are read with fetch() rather than EventSource so that credentials can travel in
// an Authorization header; reconnection works like EventSource's: after a dropped stream
// the page asks again with Last-Event-ID set to the last seq it saw, and the gateway
// replays exactly the events after it.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const TOKEN_KEY = "stargrpc.token";
  const MAX_RECONNECT_DELAY_MS = 15000;

  const state = {
    runId: null,        // the run shown
    lastSeq: 0,         // the newest seq rendered
    finished: false,    // its Result has arrived
    deadline: null,     // Date.now() value when the critic would stop the run
    retryMs: 1000,      // reconnection delay, from the server's "retry:" field
    failures: 0,        // consecutive failed connections
    abort: null,        // AbortController of the open stream
    chunks: new Map(),  // file_id -> [Uint8Array] of streamed files
    tools: new Map(),   // tool name -> catalog entry
  };

  // -- helpers ------------------------------------------------------------------------------

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function authHeaders(extra = {}) {
    const headers = { ...extra };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers["Authorization"] = `Bearer ${token}`;
    return headers;
  }

  function setConnection(text, stateName) {
    const node = $("connection");
    node.textContent = text;
    node.dataset.state = stateName;
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      return `${body.error.status}: ${body.error.message}`;
    } catch {
      return `HTTP ${response.status}`;
    }
  }

  // "1.500s" (protobuf JSON Duration) -> 1.5
  const seconds = (duration) => (duration ? parseFloat(duration) : 0);
  const outcomeName = (outcome) => (outcome || "OUTCOME_UNSPECIFIED").replace("OUTCOME_", "");
  const phaseName = (phase) => (phase || "").replace("STEP_PHASE_", "");
  const statusName = (status) => (status || "STEP_STATUS_RUNNING").replace("STEP_STATUS_", "");

  function base64Bytes(text) {
    const binary = atob(text || "");
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
    return bytes;
  }

  // -- the catalog and the form ------------------------------------------------------------

  function skeleton(schema) {
    const args = {};
    const properties = (schema && schema.properties) || {};
    const required = new Set((schema && schema.required) || []);
    for (const [name, prop] of Object.entries(properties)) {
      if ("default" in prop) args[name] = prop.default;
      else if (required.has(name)) {
        args[name] = { integer: prop.minimum ?? 1, number: prop.minimum ?? 0, boolean: false,
                       array: [], object: {} }[prop.type] ?? "";
      }
    }
    return args;
  }

  function showTool(name) {
    const entry = state.tools.get(name);
    $("tool-description").textContent = entry ? entry.description || "" : "";
    if (entry) $("arguments").value = JSON.stringify(skeleton(entry.input_schema), null, 2);
  }

  async function loadTools() {
    const response = await fetch("/v1/tools", { headers: authHeaders() });
    if (!response.ok) {
      $("form-error").textContent = `Cannot list tools: ${await errorMessage(response)}`;
      return;
    }
    const body = await response.json();
    const select = $("tool");
    select.replaceChildren();
    state.tools.clear();
    for (const entry of body.tools || []) {
      state.tools.set(entry.name, entry);
      const option = el("option", "", entry.name);
      option.value = entry.name;
      if (entry.permissions && entry.permissions.callable === false) option.disabled = true;
      select.append(option);
    }
    $("form-error").textContent = "";
    const runTool = $("run-title").textContent;  // a run re-joined before the list came
    if (runTool && state.tools.has(runTool)) select.value = runTool;
    showTool(select.value);
  }

  async function startRun(event) {
    event.preventDefault();
    $("form-error").textContent = "";
    let args;
    try {
      args = JSON.parse($("arguments").value || "{}");
    } catch (error) {
      $("form-error").textContent = `The arguments are not valid JSON: ${error.message}`;
      return;
    }
    const tool = $("tool").value;
    const response = await fetch(`/v1/tools/${encodeURIComponent(tool)}:execute`, {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify({ arguments: args }),
    });
    if (response.status !== 202) {
      $("form-error").textContent = await errorMessage(response);
      return;
    }
    const body = await response.json();
    // The run id goes into the URL: a reload (or the link) re-joins the run.
    history.pushState(null, "", `#run=${body.run_id}`);
    follow(body.run_id);
  }

  async function cancelRun() {
    if (!state.runId) return;
    const response = await fetch(`/v1/runs/${state.runId}:cancel`, {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify({ reason: "cancelled from the progress page" }),
    });
    if (!response.ok) $("form-error").textContent = await errorMessage(response);
  }

  // -- following a run ---------------------------------------------------------------------

  function follow(runId) {
    if (state.abort) state.abort.abort();
    Object.assign(state, { runId, lastSeq: 0, finished: false, deadline: null, failures: 0 });
    state.chunks.clear();
    $("run-view").hidden = false;
    $("run-title").textContent = "";
    $("run-id").textContent = runId;
    $("run-link").href = `#run=${runId}`;
    $("event-count").textContent = "0";
    $("steps").replaceChildren();
    $("notices").replaceChildren();
    $("heartbeat").hidden = true;
    $("result").hidden = true;
    $("cancel-button").disabled = false;
    setRunState("RUNNING");
    connect(runId);
  }

  async function connect(runId) {
    const abort = new AbortController();
    state.abort = abort;
    const headers = authHeaders({ Accept: "text/event-stream" });
    if (state.lastSeq > 0) headers["Last-Event-ID"] = String(state.lastSeq);
    setConnection(state.lastSeq > 0 ? "re-joining" : "connecting", "connecting");
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
        $("form-error").textContent = response.status === 404
          ? `Run ${runId} is unknown here (it may have expired): ${message}` : message;
        return;
      }
      setConnection("live", "live");
      state.failures = 0;
      await readStream(response.body, runId);
    } catch (error) {
      if (abort.signal.aborted) return;
    }
    if (state.runId !== runId || state.finished || abort.signal.aborted) {
      if (state.finished) setConnection("finished", "closed");
      return;
    }
    // The stream ended before the Result: reconnect and resume after the last seq.
    state.failures += 1;
    const delay = Math.min(state.retryMs * 2 ** (state.failures - 1), MAX_RECONNECT_DELAY_MS);
    setConnection(`reconnecting in ${(delay / 1000).toFixed(1)} s`, "connecting");
    setTimeout(() => { if (state.runId === runId && !state.finished) connect(runId); }, delay);
  }

  // Parses text/event-stream (https://html.spec.whatwg.org/#event-stream-interpretation).
  async function readStream(body, runId) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let message = { event: "message", data: [], id: null };
    for (;;) {
      const { value, done } = await reader.read();
      if (done || state.runId !== runId) return;
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (message.data.length) dispatch(message.event, message.data.join("\n"));
          message = { event: "message", data: [], id: null };
          continue;
        }
        if (line.startsWith(":")) continue;  // keep-alive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (field === "data") message.data.push(text);
        else if (field === "event") message.event = text;
        else if (field === "id") message.id = text;
        else if (field === "retry" && /^\d+$/.test(text)) state.retryMs = Number(text);
      }
    }
  }

  function dispatch(kind, data) {
    const payload = JSON.parse(data);
    if (kind === "error") {
      $("form-error").textContent = `${payload.error.status}: ${payload.error.message}`;
      return;
    }
    const seq = Number(payload.seq || 0);
    if (seq <= state.lastSeq) return;  // already shown (a replay overlapping a reconnect)
    state.lastSeq = seq;
    $("event-count").textContent = String(seq);
    if (payload.critic_time_left !== undefined) {
      // Counted from the event's own time, so a replayed event (after a reload) does not
      // restart the countdown.
      const stamped = payload.time ? Date.parse(payload.time) : Date.now();
      state.deadline = stamped + seconds(payload.critic_time_left) * 1000;
    }
    if (payload.step) onStep(payload.step);
    else if (payload.heartbeat) onHeartbeat(payload.heartbeat);
    else if (payload.notice) onNotice(payload.notice);
    else if (payload.file_chunk) onFileChunk(payload.file_chunk);
    else if (payload.result) onResult(payload.result);
  }

  // -- rendering ---------------------------------------------------------------------------

  function stepNode(id) {
    return $("steps").querySelector(`li[data-step-id="${CSS.escape(id)}"]`);
  }

  function onStep(event) {
    const step = event.step || {};
    const phase = phaseName(event.phase);
    let node = stepNode(step.id);
    if (phase === "START" || !node) {
      node = node || el("li", "step");
      node.dataset.stepId = step.id;
      const head = el("div", "step-head");
      head.append(el("span", "step-status"), el("span", "step-title", step.title || step.id),
                  el("span", "step-kind", step.kind || ""), el("span", "step-time", ""));
      node.replaceChildren(head, el("div", "step-summary", ""), el("pre", "step-output"),
                           el("ul", "steps children"));
      const parent = step.parent_id ? stepNode(step.parent_id) : null;
      (parent ? parent.querySelector(":scope > ul.children") : $("steps")).append(node);
      if (!step.parent_id) showRunTool(step.title);
      setStepStatus(node, "RUNNING");
    }
    if (phase === "DELTA") {
      const output = node.querySelector(":scope > pre.step-output");
      const piece = el("span", event.channel ? `channel-${event.channel}` : "", event.delta || "");
      output.append(piece);
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
    if (state.tools.has(name) && $("tool").value !== name) {
      $("tool").value = name;
      showTool(name);
    }
  }

  function setStepStatus(node, status) {
    node.dataset.status = status;
    node.querySelector(":scope > .step-head > .step-status").textContent =
      { RUNNING: "…", COMPLETE: "✓", ERROR: "✗" }[status] || status;
  }

  function onHeartbeat(heartbeat) {
    $("heartbeat").hidden = false;
    $("heartbeat-message").textContent = heartbeat.message || "working";
    const bar = $("heartbeat-progress");
    if (heartbeat.progress !== undefined) bar.value = heartbeat.progress;
    else bar.removeAttribute("value");
  }

  function onNotice(notice) {
    const level = (notice.level || "").replace("NOTICE_LEVEL_", "").toLowerCase();
    const item = el("li", `notice ${level}`, `${notice.code || ""} ${notice.message || ""}`.trim());
    $("notices").append(item);
  }

  function onFileChunk(chunk) {
    const parts = state.chunks.get(chunk.file_id) || [];
    parts.push(base64Bytes(chunk.data));
    state.chunks.set(chunk.file_id, parts);
  }

  function setRunState(name) {
    const badge = $("run-state");
    badge.dataset.state = name;
    badge.textContent = name.toLowerCase();
  }

  function onResult(result) {
    state.finished = true;
    state.deadline = null;
    $("cancel-button").disabled = true;
    $("heartbeat").hidden = true;
    const outcome = outcomeName(result.outcome);
    setRunState(outcome);
    const section = $("result");
    section.hidden = false;
    section.dataset.outcome = outcome;
    $("result-outcome").textContent = outcome;
    $("result-outcome").dataset.state = outcome;
    $("result-duration").textContent = `in ${seconds(result.duration).toFixed(2)} s`;
    $("result-error").textContent = result.error
      ? `${result.error.code}: ${result.error.message}` : "";
    $("result-output").textContent = result.output || "";
    const structured = $("result-structured");
    structured.hidden = result.structured_output === undefined;
    structured.textContent = structured.hidden
      ? "" : JSON.stringify(result.structured_output, null, 2);
    const writeback = result.writeback || {};
    renderFiles(writeback.sent_files || []);
    renderList($("result-tools"), writeback.injected_tools || [],
               (t) => `${t.name}: ${t.description || ""}`);
    renderList($("result-messages"), writeback.sent_rich_messages || [],
               (m) => `${m.kind}: ${JSON.stringify(m.payload || {})}`);
  }

  function renderFiles(files) {
    const list = $("result-files");
    list.replaceChildren();
    if (!files.length) list.append(el("li", "muted", "none"));
    for (const file of files) {
      const item = el("li");
      const parts = file.streamed ? state.chunks.get(file.file_id) : [base64Bytes(file.content)];
      if (parts) {
        const blob = new Blob(parts, { type: file.mime_type || "application/octet-stream" });
        const link = el("a", "download", file.name);
        link.href = URL.createObjectURL(blob);
        link.download = file.name;
        item.append(link);
      } else {
        item.append(el("span", "", `${file.name} (not delivered to this page)`));
      }
      item.append(el("span", "muted", ` ${file.mime_type || ""}, ${file.size || 0} bytes`));
      list.append(item);
    }
  }

  function renderList(list, items, describe) {
    list.replaceChildren();
    if (!items.length) list.append(el("li", "muted", "none"));
    for (const entry of items) list.append(el("li", "", describe(entry)));
  }

  function tick() {
    const node = $("time-left");
    if (state.deadline === null || state.finished) {
      node.hidden = true;
      return;
    }
    const left = Math.max(0, (state.deadline - Date.now()) / 1000);
    node.hidden = false;
    node.dataset.seconds = left.toFixed(1);
    node.textContent = `critic stops it in ${left.toFixed(1)} s without progress`;
  }

  // -- start-up ----------------------------------------------------------------------------

  function runFromUrl() {
    const match = /^#run=([A-Za-z0-9_-]+)$/.exec(location.hash);
    if (match && match[1] !== state.runId) follow(match[1]);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("token").value = sessionStorage.getItem(TOKEN_KEY) || "";
    $("token").addEventListener("change", () => {
      sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
      loadTools();
    });
    $("tool").addEventListener("change", () => showTool($("tool").value));
    $("run-form").addEventListener("submit", startRun);
    $("cancel-button").addEventListener("click", cancelRun);
    window.addEventListener("hashchange", runFromUrl);
    window.addEventListener("popstate", runFromUrl);
    setInterval(tick, 200);
    loadTools();
    runFromUrl();
  });
})();
