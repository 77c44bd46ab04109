// The session picker: for the python and shell tools, run in one of the caller's sessions
// (a sandbox kept across calls: files, a live interpreter) or open a new one, and see the
// files in its folder.

import { authHeaders } from "./api.js";
import { $, el } from "./dom.js";
import { hideError, showRefusal } from "./errors.js";

// The tools a session runs; a session's kind is its tool's name.
const SESSION_TOOLS = new Set(["python", "shell"]);

// The tool the picker is shown for ("" when hidden).
let shownFor = "";

// The session id the next run goes to ("" for none).
export function selectedSession() {
  return shownFor ? $("session").value : "";
}

// Shows the picker when `tool` runs in sessions, listing the caller's sessions of its kind.
export async function showSessionsFor(tool) {
  shownFor = SESSION_TOOLS.has(tool) ? tool : "";
  $("session-box").hidden = !shownFor;
  if (shownFor) await refreshSessions();
}

// Lists the sessions (and the chosen one's files) again; keeps the choice when it lives.
export async function refreshSessions() {
  if (!shownFor) return;
  const response = await fetch("/v1/sessions?files=true", { headers: authHeaders() });
  if (!response.ok) return;  // the run form says why the server refuses the caller
  const sessions = ((await response.json()).sessions || []).filter((s) => s.kind === shownFor);
  const select = $("session");
  const chosen = select.value;
  select.replaceChildren(Object.assign(el("option", "", "none: a fresh sandbox per run"),
                                       { value: "" }));
  for (const session of sessions) {
    const label = `${session.session_id} (${session.calls || 0} calls${session.busy ? ", busy" : ""})`;
    select.append(Object.assign(el("option", "", label), { value: session.session_id }));
  }
  if (sessions.some((s) => s.session_id === chosen)) select.value = chosen;
  showFiles(sessions.find((s) => s.session_id === select.value));
}

function showFiles(session) {
  const list = $("session-files");
  list.replaceChildren();
  $("session-files-box").hidden = !session;
  if (!session) return;
  const files = session.files || [];
  if (!files.length) list.append(el("li", "help", "no files yet"));
  for (const file of files) list.append(el("li", "", `${file.name} (${file.size || 0} bytes)`));
}

// Opens a session of the tool's kind and picks it.
export async function newSession() {
  if (!shownFor) return;
  const response = await fetch("/v1/sessions", {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ kind: shownFor }),
  });
  if (!response.ok) {
    await showRefusal("The session was not opened", response);
    return;
  }
  hideError();
  const session = await response.json();
  await refreshSessions();
  $("session").value = session.session_id;
  await refreshSessions();
}
