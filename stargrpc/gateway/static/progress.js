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
  const ARGS_KEY = "stargrpc.args.";  // + run id: the arguments a run was started with here
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
    runArgs: null,      // the arguments of the run shown, when this tab started it
    streamed: "",       // the stdout DELTA text the run streamed, to show its output once
    softTimeout: null,  // the critic's quiet period, in seconds
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

  // -- the arguments form, generated from the tool's JSON Schema ---------------------------

  // Multi-line code fields get a code editor rather than a one-line input.
  const CODE_FIELDS = new Set(["code", "command", "script", "source"]);
  let fieldCount = 0;

  function resolve(schema, root) {
    let current = schema || {};
    for (let depth = 0; depth < 20 && current.$ref; depth += 1) {
      const name = current.$ref.replace(/^#\/(\$defs|definitions)\//, "");
      current = { ...((root.$defs || root.definitions || {})[name] || {}),
                  ...Object.fromEntries(Object.entries(current).filter(([k]) => k !== "$ref")) };
    }
    const options = current.anyOf || current.oneOf;
    if (options) {  // Optional[X] is anyOf [X, null]: edit X
      const real = options.filter((option) => option.type !== "null");
      if (real.length === 1) {
        return { ...resolve(real[0], root), description: current.description,
                 default: current.default, title: current.title };
      }
    }
    return current;
  }

  function typeOf(schema) {
    if (Array.isArray(schema.enum)) return "enum";
    if (Array.isArray(schema.type)) return schema.type.find((t) => t !== "null") || "json";
    if (schema.type) return schema.type;
    if (schema.properties) return "object";
    return "json";
  }

  // A field: { node, read() -> value | undefined (left out), write(value) }.
  function buildField(name, rawSchema, root, required, path) {
    const schema = resolve(rawSchema, root);
    const kind = typeOf(schema);
    const id = `arg-${(fieldCount += 1)}`;
    const label = schema.title || name;
    const help = schema.description ? el("p", "help", schema.description) : null;
    if (help) help.id = `${id}-help`;
    const labelNode = (forId) => {
      const node = el("label", "", label);
      node.htmlFor = forId;
      if (required) {
        const mark = el("span", "required-mark", "*");
        mark.setAttribute("aria-hidden", "true");
        node.append(mark, el("span", "visually-hidden", " (required)"));
      }
      return node;
    };
    const describe = (control) => {
      if (help) control.setAttribute("aria-describedby", help.id);
      if (required) control.required = true;
      control.dataset.path = path;
      return control;
    };

    const fieldset = () => {
      const box = el("fieldset");
      box.dataset.path = path;
      const legend = el("legend", "", label);
      if (required) legend.append(el("span", "visually-hidden", " (required)"));
      box.append(legend);
      if (help) box.append(help);
      return box;
    };

    if (kind === "object" && schema.properties) {
      const box = fieldset();
      const needed = new Set(schema.required || []);
      const children = Object.entries(schema.properties).map(([key, sub]) =>
        [key, buildField(key, sub, root, needed.has(key), path ? `${path}.${key}` : key)]);
      for (const [, child] of children) box.append(child.node);
      return {
        node: box,
        read() {
          const value = {};
          for (const [key, child] of children) {
            const item = child.read();
            if (item !== undefined) value[key] = item;
          }
          return value;
        },
        write(value) {
          const given = value && typeof value === "object" ? value : {};
          for (const [key, child] of children) child.write(given[key]);
        },
      };
    }

    const wrap = el("div", "field");
    let control;
    let read;
    let write;
    if (kind === "boolean") {
      control = describe(el("input"));
      control.type = "checkbox";
      control.id = id;
      const line = el("div", "check");
      const text = labelNode(id);
      text.style.margin = "0";
      line.append(control, text);
      wrap.append(line);
      read = () => control.checked;
      write = (value) => { control.checked = value === undefined ? schema.default === true : !!value; };
    } else if (kind === "enum") {
      control = describe(el("select"));
      control.id = id;
      if (!required) control.append(Object.assign(el("option", "", "—"), { value: "" }));
      schema.enum.forEach((choice, index) => {
        const option = el("option", "", String(choice));
        option.value = String(index);
        control.append(option);
      });
      wrap.append(labelNode(id), control);
      read = () => (control.value === "" ? undefined : schema.enum[Number(control.value)]);
      write = (value) => {
        const chosen = value === undefined ? schema.default : value;
        const index = schema.enum.findIndex((choice) => choice === chosen);
        control.value = index >= 0 ? String(index) : (required ? "0" : "");
      };
    } else if (kind === "integer" || kind === "number") {
      control = describe(el("input"));
      control.type = "number";
      control.id = id;
      control.step = kind === "integer" ? "1" : "any";
      if (schema.minimum !== undefined) control.min = schema.minimum;
      if (schema.maximum !== undefined) control.max = schema.maximum;
      wrap.append(labelNode(id), control);
      read = () => (control.value.trim() === "" ? (required ? null : undefined)
        : Number(control.value));
      write = (value) => {
        const shown = value === undefined ? schema.default : value;
        control.value = shown === undefined || shown === null ? "" : String(shown);
      };
    } else if (kind === "string") {
      const code = CODE_FIELDS.has(name) || schema.format === "multiline";
      control = describe(el(code ? "textarea" : "input"));
      control.id = id;
      if (code) {
        control.className = "code";
        control.rows = 8;
        control.spellcheck = false;
        control.addEventListener("keydown", (event) => {
          // Tab indents in the code editor; Escape, then Tab, leaves it (keyboard users).
          if (event.key === "Escape") control.dataset.leave = "1";
          if (event.key === "Tab" && !event.shiftKey && !control.dataset.leave) {
            event.preventDefault();
            control.setRangeText("    ", control.selectionStart, control.selectionEnd, "end");
          }
          if (event.key !== "Escape" && event.key !== "Tab") delete control.dataset.leave;
        });
      } else {
        control.type = "text";
      }
      wrap.append(labelNode(id), control);
      if (code) wrap.append(el("p", "help", "Tab indents; press Escape, then Tab, to move on."));
      read = () => (control.value === "" && !required ? undefined : control.value);
      write = (value) => {
        const shown = value === undefined ? schema.default : value;
        control.value = shown === undefined || shown === null ? "" : String(shown);
      };
    } else if (kind === "array" && schema.items && typeOf(resolve(schema.items, root)) !== "json") {
      const box = fieldset();
      const list = el("div", "array-items");
      const add = el("button", "small", `Add ${label.toLowerCase()} item`);
      add.type = "button";
      let items = [];
      const addItem = (value) => {
        const index = items.length;
        const field = buildField(`${label} ${index + 1}`, schema.items, root, false, `${path}[${index}]`);
        const row = el("div", "array-item");
        const remove = el("button", "small", "Remove");
        remove.type = "button";
        remove.setAttribute("aria-label", `Remove ${label} item ${index + 1}`);
        const entry = { field, row };
        remove.addEventListener("click", () => {
          items = items.filter((other) => other !== entry);
          row.remove();
          add.focus();
        });
        row.append(field.node, remove);
        list.append(row);
        items.push(entry);
        field.write(value);
        return field;
      };
      add.addEventListener("click", () => {
        addItem(undefined);
        const last = list.lastElementChild.querySelector("input, select, textarea");
        if (last) last.focus();
      });
      box.append(list, add);
      return {
        node: box,
        read() {
          const value = items.map((entry) => entry.field.read()).filter((v) => v !== undefined);
          return value.length || required ? value : undefined;
        },
        write(value) {
          items = [];
          list.replaceChildren();
          const given = value === undefined ? schema.default : value;
          for (const item of Array.isArray(given) ? given : []) addItem(item);
        },
      };
    } else {
      // Anything else (free-form objects, mixed types) is edited as JSON.
      control = describe(el("textarea"));
      control.id = id;
      control.rows = 3;
      control.spellcheck = false;
      wrap.append(labelNode(id), control,
                  el("p", "help", kind === "object" ? "A JSON object." : "JSON."));
      read = () => {
        const text = control.value.trim();
        if (!text) return required ? {} : undefined;
        try {
          return JSON.parse(text);
        } catch (error) {
          throw new Error(`${label}: not valid JSON (${error.message})`);
        }
      };
      write = (value) => {
        const shown = value === undefined ? schema.default : value;
        control.value = shown === undefined ? "" : JSON.stringify(shown, null, 2);
      };
    }
    if (help) wrap.append(help);
    write(undefined);
    return { node: wrap, read, write };
  }

  const argsForm = { field: null, view: "form" };

  function renderForm(entry, values) {
    fieldCount = 0;
    const schema = (entry && entry.input_schema) || { type: "object", properties: {} };
    const root = { type: "object", ...schema };
    argsForm.field = buildField("arguments", root, root, true, "");
    const node = argsForm.field.node;
    const legend = node.querySelector(":scope > legend");
    if (legend) legend.textContent = "Arguments";
    if (!Object.keys(schema.properties || {}).length) {
      node.append(el("p", "help", "This tool takes no arguments."));
    }
    $("arguments-form").replaceChildren(node);
    if (values !== undefined) argsForm.field.write(values);
    $("arguments").value = JSON.stringify(argsForm.field.read(), null, 2);
  }

  // The arguments as the view in use shows them.
  function currentArguments() {
    if (argsForm.view === "json") {
      const parsed = JSON.parse($("arguments").value || "{}");
      if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) {
        throw new Error("the arguments must be a JSON object");
      }
      return parsed;
    }
    return argsForm.field ? argsForm.field.read() : {};
  }

  function setView(view) {
    try {
      if (view === "json" && argsForm.view === "form") {
        $("arguments").value = JSON.stringify(currentArguments(), null, 2);
      } else if (view === "form" && argsForm.view === "json") {
        argsForm.field.write(currentArguments());
      }
    } catch (error) {
      showError(`Cannot switch views: ${error.message}`);
      return;
    }
    hideError();
    argsForm.view = view;
    $("arguments-form").hidden = view !== "form";
    $("json-view").hidden = view !== "json";
    $("view-form").setAttribute("aria-pressed", String(view === "form"));
    $("view-json").setAttribute("aria-pressed", String(view === "json"));
  }

  function showTool(name, values) {
    const entry = state.tools.get(name);
    $("tool-description").textContent = entry ? entry.description || "" : "";
    renderForm(entry, values);
  }

  async function loadTools() {
    const response = await fetch("/v1/tools", { headers: authHeaders() });
    if (!response.ok) {
      await showRefusal("Cannot list the tools", response);
      return;
    }
    const body = await response.json();
    const select = $("tool");
    const filter = $("filter-tool");
    const chosenFilter = filter.value;
    select.replaceChildren();
    filter.replaceChildren(Object.assign(el("option", "", "any"), { value: "" }));
    state.tools.clear();
    for (const entry of body.tools || []) {
      state.tools.set(entry.name, entry);
      const option = el("option", "", entry.name);
      option.value = entry.name;
      if (entry.permissions && entry.permissions.callable === false) option.disabled = true;
      select.append(option);
      filter.append(Object.assign(el("option", "", entry.name), { value: entry.name }));
    }
    filter.value = chosenFilter;
    hideError();
    const runTool = $("run-title").textContent;  // a run re-joined before the list came
    if (runTool && state.tools.has(runTool)) select.value = runTool;
    showTool(select.value, state.runArgs || undefined);
    watchRuns();
  }

  // -- errors --------------------------------------------------------------------------------

  function hideError() {
    $("form-error").hidden = true;
    $("form-error").replaceChildren();
  }

  function showError(message, violations = [], hint = "") {
    const box = $("form-error");
    box.replaceChildren(el("strong", "", message));
    if (violations.length) {
      const list = el("ul");
      for (const v of violations) {
        const item = el("li");
        item.append(el("code", "", v.field || "request"), ` ${v.description || ""}`);
        list.append(item);
      }
      box.append(list);
    }
    if (hint) box.append(el("p", "", hint));
    box.hidden = false;
  }

  // A refused call: the status, every field violation with its description, and what to do.
  async function showRefusal(what, response) {
    let body = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    const error = (body && body.error) || {};
    const violations = [];
    for (const detail of error.details || []) {
      for (const v of detail.fieldViolations || detail.field_violations || []) violations.push(v);
    }
    let hint = "";
    if (response.status === 401) {
      hint = "No valid API key was sent: paste one under Credentials above.";
      $("credentials").open = true;
    } else if (response.status === 403) {
      hint = "Your key may not do this; ask for a role that allows it.";
    }
    const status = error.status ? `${error.status}: ` : `HTTP ${response.status}: `;
    showError(`${what}. ${status}${error.message || ""}`, violations, hint);
  }

  async function startRun(event) {
    event.preventDefault();
    hideError();
    if (!$("tool").value) {
      // Enter pressed in the key field before the tools were listed: there is nothing to
      // run yet, and the key is what the list was waiting for.
      await loadTools();
      return;
    }
    let args;
    try {
      args = currentArguments();
    } catch (error) {
      showError(`The arguments are not valid: ${error.message}`);
      return;
    }
    const tool = $("tool").value;
    const response = await fetch(`/v1/tools/${encodeURIComponent(tool)}:execute`, {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify({ arguments: args }),
    });
    if (response.status !== 202) {
      // The previous run's panel goes away: the refusal is about this call, not that run.
      if (state.abort) state.abort.abort();
      state.runId = null;
      $("run-view").hidden = true;
      history.replaceState(null, "", location.pathname);
      await showRefusal(`${tool} was not started`, response);
      return;
    }
    const body = await response.json();
    sessionStorage.setItem(`${ARGS_KEY}${body.run_id}`, JSON.stringify(args));
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
    if (!response.ok) await showRefusal("The run was not cancelled", response);
  }

  async function steerRun(event) {
    event.preventDefault();
    const message = $("steer-message").value.trim();
    if (!state.runId || !message) return;
    const response = await fetch(`/v1/runs/${state.runId}:steer`, {
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

  // -- the runs list ---------------------------------------------------------------------------

  const runsWatch = { abort: null };

  function runsQuery() {
    const params = new URLSearchParams({ page_size: "30" });
    if ($("filter-tool").value) params.set("tool", $("filter-tool").value);
    const outcome = $("filter-outcome").value;
    if (outcome === "running") params.set("state", "running");
    else if (outcome) params.set("outcome", outcome);
    return params.toString();
  }

  async function watchRuns() {
    if (runsWatch.abort) runsWatch.abort.abort();
    const abort = new AbortController();
    runsWatch.abort = abort;
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
      const status = running ? "RUNNING" : outcomeName(run.outcome);
      const button = el("button", "run-item");
      button.type = "button";
      button.dataset.runId = run.run_id;
      if (run.run_id === state.runId) button.setAttribute("aria-current", "true");
      const line = el("span", "run-line");
      const badge = el("span", "badge", status.toLowerCase());
      badge.dataset.state = status;
      line.append(el("span", "run-tool", run.tool_name), badge);
      const meta = [new Date(run.started_at).toLocaleTimeString(), duration(run)];
      if (run.principal) meta.push(run.principal);
      if (running && run.current_step) meta.push(run.current_step);
      button.append(line, el("span", "run-meta", meta.join(" · ")));
      button.setAttribute("aria-label",
        `${run.tool_name}, ${status.toLowerCase()}, started ${meta[0]}, ${meta[1]}`);
      button.addEventListener("click", () => {
        history.pushState(null, "", `#run=${run.run_id}`);
        follow(run.run_id);
        $("run-title").focus();
      });
      const item = el("li");
      item.append(button);
      list.append(item);
    }
  }

  // -- following a run ---------------------------------------------------------------------

  function follow(runId) {
    if (state.abort) state.abort.abort();
    Object.assign(state, { runId, lastSeq: 0, finished: false, deadline: null, failures: 0 });
    state.chunks.clear();
    state.streamed = "";
    state.softTimeout = null;
    const saved = sessionStorage.getItem(`${ARGS_KEY}${runId}`);
    state.runArgs = saved ? JSON.parse(saved) : null;
    $("run-arguments").hidden = state.runArgs === null;
    $("run-arguments-json").textContent = saved ? JSON.stringify(state.runArgs, null, 2) : "";
    hideError();
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
    $("steer-form").hidden = !state.canSteer;
    for (const button of $("runs-list").querySelectorAll("button.run-item")) {
      if (button.dataset.runId === runId) button.setAttribute("aria-current", "true");
      else button.removeAttribute("aria-current");
    }
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
        showError(response.status === 404
          ? `Run ${runId} is unknown here (it may have expired, or belong to another key): ${message}`
          : message, [], response.status === 401 ? "Paste an API key under Credentials above." : "");
        return;
      }
      setConnection("live", "live");
      state.failures = 0;
      await readEvents(response.body, dispatch, () => state.runId !== runId);
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
  async function readEvents(body, onMessage, stopped) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let message = { event: "message", data: [], id: null };
    for (;;) {
      const { value, done } = await reader.read();
      if (done || stopped()) return;
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (message.data.length) onMessage(message.event, message.data.join("\n"));
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
      showError(`${payload.error.status}: ${payload.error.message}`);
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
      if (state.softTimeout === null) state.softTimeout = Math.round(seconds(payload.critic_time_left));
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
      if (step.parent_id) announce(`Step started: ${step.title || step.id}`);
    }
    if (phase === "DELTA") {
      const output = node.querySelector(":scope > pre.step-output");
      const piece = el("span", event.channel ? `channel-${event.channel}` : "", event.delta || "");
      output.append(piece);
      if (event.channel !== "stderr") state.streamed += event.delta || "";
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
    if (state.tools.has(name) && ($("tool").value !== name || state.runArgs)) {
      $("tool").value = name;
      showTool(name, state.runArgs || undefined);
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
    $("steer-form").hidden = true;
    $("heartbeat").hidden = true;
    const outcome = outcomeName(result.outcome);
    setRunState(outcome);
    announce(`Run finished: ${outcome.toLowerCase()}`);
    const section = $("result");
    section.hidden = false;
    section.dataset.outcome = outcome;
    $("result-outcome").textContent = outcome;
    $("result-outcome").dataset.state = outcome;
    $("result-duration").textContent = `in ${seconds(result.duration).toFixed(2)} s`;
    $("result-error").textContent = result.error
      ? `${result.error.code}: ${result.error.message}` : "";
    // The output the steps streamed is shown there, once; the Result's own text (what the
    // model reads, which may repeat it) stays folded away.
    const output = result.output || "";
    const streamed = state.streamed.trim();
    const repeated = streamed !== "" && output.includes(streamed);
    $("result-output").textContent = repeated ? "" : output;
    $("result-text").hidden = !repeated;
    $("result-output-full").textContent = repeated ? output : "";
    const structured = $("result-structured");
    structured.replaceChildren();
    $("result-structured-box").hidden = result.structured_output === undefined;
    if (result.structured_output !== undefined) {
      structured.append(tree(result.structured_output, "structured_output", true));
    }
    const writeback = result.writeback || {};
    renderFiles(writeback.sent_files || []);
    $("files-box").hidden = !(writeback.sent_files || []).length;
    const tools = writeback.injected_tools || [];
    $("tools-box").hidden = !tools.length;
    $("result-tools").replaceChildren(...tools.map((t) => el("li", "", `${t.name}: ${t.description || ""}`)));
    const messages = writeback.sent_rich_messages || [];
    $("messages-box").hidden = !messages.length;
    $("result-messages").replaceChildren(...messages.map(richMessage));
  }

  // A JSON value as a tree of nested <details>, the top levels open.
  function tree(value, label, open) {
    if (value === null || typeof value !== "object") {
      const leaf = el("div");
      leaf.append(el("span", "key", `${label}: `), el("span", "value", JSON.stringify(value)));
      return leaf;
    }
    const entries = Array.isArray(value) ? value.map((v, i) => [String(i), v]) : Object.entries(value);
    const node = el("details");
    node.open = open;
    node.append(el("summary", "key",
      `${label} ${Array.isArray(value) ? `[${entries.length}]` : `{${entries.length}}`}`));
    const list = el("ul");
    for (const [key, item] of entries) {
      const li = el("li");
      li.append(tree(item, key, false));
      list.append(li);
    }
    node.append(list);
    return node;
  }

  // -- rich messages, by kind ---------------------------------------------------------------

  function safeUrl(text, allowData) {
    try {
      const url = new URL(String(text), location.href);
      if (url.protocol === "https:" || url.protocol === "http:") return url.href;
      if (allowData && url.protocol === "data:" && /^data:image\/(png|jpeg|gif|webp);/.test(url.href)) {
        return url.href;
      }
    } catch {
      return null;
    }
    return null;
  }

  // Markdown, the safe subset: headings, paragraphs, lists, code blocks, **bold**, *italic*,
  // `code` and [links](https://…). Built as DOM nodes: tool text is never parsed as HTML.
  function inline(text) {
    const nodes = [];
    const pattern = /(\*\*([^*]+)\*\*|\*([^*]+)\*|`([^`]+)`|\[([^\]]+)\]\(([^)\s]+)\))/g;
    let at = 0;
    for (const match of text.matchAll(pattern)) {
      if (match.index > at) nodes.push(document.createTextNode(text.slice(at, match.index)));
      if (match[2]) nodes.push(el("strong", "", match[2]));
      else if (match[3]) nodes.push(el("em", "", match[3]));
      else if (match[4]) nodes.push(el("code", "", match[4]));
      else {
        const href = safeUrl(match[6], false);
        if (href) {
          const link = el("a", "", match[5]);
          link.href = href;
          link.rel = "noopener noreferrer";
          nodes.push(link);
        } else nodes.push(document.createTextNode(match[5]));
      }
      at = match.index + match[0].length;
    }
    if (at < text.length) nodes.push(document.createTextNode(text.slice(at)));
    return nodes;
  }

  function markdown(source) {
    const box = el("div", "markdown");
    const lines = String(source).split("\n");
    let list = null;
    for (let i = 0; i < lines.length; i += 1) {
      const line = lines[i];
      if (line.startsWith("```")) {
        const code = [];
        for (i += 1; i < lines.length && !lines[i].startsWith("```"); i += 1) code.push(lines[i]);
        box.append(el("pre", "", code.join("\n")));
        list = null;
        continue;
      }
      const heading = /^(#{1,4})\s+(.*)$/.exec(line);
      const bullet = /^\s*[-*]\s+(.*)$/.exec(line);
      if (heading) {
        const node = el(`h${Math.min(6, heading[1].length + 3)}`);
        node.append(...inline(heading[2]));
        box.append(node);
        list = null;
      } else if (bullet) {
        if (!list) box.append((list = el("ul")));
        const item = el("li");
        item.append(...inline(bullet[1]));
        list.append(item);
      } else if (line.trim()) {
        const para = el("p");
        para.append(...inline(line));
        box.append(para);
        list = null;
      } else list = null;
    }
    return box;
  }

  function richMessage(message) {
    const payload = message.payload || {};
    const kind = (message.kind || "").toLowerCase();
    const box = el("figure", `message message-${kind || "unknown"}`);
    box.style.margin = "0";
    if (kind === "markdown" || kind === "text") {
      box.append(markdown(payload.markdown ?? payload.text ?? ""));
    } else if (kind === "table") {
      const table = el("table");
      if (payload.title) table.append(el("caption", "", String(payload.title)));
      const columns = payload.columns || [];
      const head = el("tr");
      for (const column of columns) head.append(Object.assign(el("th", "", String(column)), { scope: "col" }));
      const thead = el("thead");
      thead.append(head);
      const tbody = el("tbody");
      for (const row of payload.rows || []) {
        const tr = el("tr");
        for (const cell of Array.isArray(row) ? row : columns.map((c) => row[c])) {
          tr.append(el("td", "", cell === undefined || cell === null ? "" : String(cell)));
        }
        tbody.append(tr);
      }
      table.append(thead, tbody);
      box.append(table);
    } else if (kind === "image") {
      // https or image data only: the page's Content-Security-Policy refuses plain http.
      const src = safeUrl(payload.url || payload.src || "", true);
      if (src && !src.startsWith("http:")) {
        const image = el("img");
        image.src = src;
        image.alt = String(payload.alt || payload.caption || "image from the tool");
        box.append(image);
      } else box.append(el("p", "muted", "An image the page cannot show (not an https or image data URL)."));
      if (payload.caption) box.append(el("figcaption", "", String(payload.caption)));
    } else if (kind === "link" || kind === "link_card" || kind === "card") {
      const href = safeUrl(payload.url || "", false);
      const title = String(payload.title || payload.url || "link");
      box.classList.add("link-card");
      if (href) {
        const link = el("a", "", title);
        link.href = href;
        link.rel = "noopener noreferrer";
        box.append(link);
      } else box.append(el("strong", "", title));
      if (payload.description) box.append(el("p", "", String(payload.description)));
      if (href) box.append(el("p", "muted", new URL(href).host));
    } else {
      box.append(el("figcaption", "", `${message.kind || "message"}`), tree(payload, "payload", true));
    }
    return box;
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

  // New events are announced to screen readers, a few at a time.
  function announce(text) {
    const region = $("announcer");
    region.append(el("p", "", text));
    while (region.childElementCount > 5) region.firstElementChild.remove();
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
    const quiet = state.softTimeout || Math.ceil(left);
    node.textContent = `stops if nothing happens for ${quiet} s · ${Math.ceil(left)} s left`;
  }

  // -- start-up ----------------------------------------------------------------------------

  function runFromUrl() {
    const match = /^#run=([A-Za-z0-9_-]+)$/.exec(location.hash);
    if (match && match[1] !== state.runId) follow(match[1]);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("token").value = sessionStorage.getItem(TOKEN_KEY) || "";
    // Nothing works without a key on most servers: show where it goes until one is given.
    $("credentials").open = !$("token").value;
    $("token").addEventListener("change", () => {
      sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
      loadTools();
    });
    $("tool").addEventListener("change", () => { state.runArgs = null; showTool($("tool").value); });
    $("run-form").addEventListener("submit", startRun);
    $("cancel-button").addEventListener("click", cancelRun);
    $("steer-form").addEventListener("submit", steerRun);
    $("view-form").addEventListener("click", () => setView("form"));
    $("view-json").addEventListener("click", () => setView("json"));
    $("filter-tool").addEventListener("change", watchRuns);
    $("filter-outcome").addEventListener("change", watchRuns);
    $("run-title").tabIndex = -1;
    fetch("/v1/capabilities").then((r) => (r.ok ? r.json() : {})).then((caps) => {
      state.canSteer = !!caps.steer;
      $("steer-form").hidden = !state.canSteer || !state.runId || state.finished;
    }).catch(() => {});
    window.addEventListener("hashchange", runFromUrl);
    window.addEventListener("popstate", runFromUrl);
    setInterval(tick, 200);
    loadTools();
    runFromUrl();
  });
})();
