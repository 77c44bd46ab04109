// The run state of the run shown (what its tools keep through ctx.state): the keys and
// values of its `run` scope and of its call tree's `tree` scope, read from the admin-only
// GET /v1/state/{scope}. The section shows only when the viewer may read them: for anyone
// else the gateway answers 403 (401 without a key) and the section stays hidden.

import { authHeaders, savedToken } from "./api.js";
import { $, el } from "./dom.js";
import { shown } from "./state.js";

// The most keys shown per scope (the API's largest page); more are counted, not listed.
const MAX_KEYS = 1000;

// The root of the shown run's call tree, from its first event (null until then).
let rootRunId = null;

// The key the state API refused (each refusal is an audit record): not asked again with
// it, until another key is given.
let refusedKey = null;

// Empties and hides the section, for the run `shown` now names.
export function resetRunStateView() {
  rootRunId = null;
  $("state-box").hidden = true;
  $("state-run-entries").replaceChildren();
  $("state-tree-entries").replaceChildren();
}

// Notes the shown run's tree root (RunEvent.root_run_id, set on its first event) and reads
// its state once the root is known.
export function noteRootRun(root) {
  if (!root || rootRunId !== null) return;
  rootRunId = root;
  refreshRunState();
}

// One scope's entries, or null when the viewer may not read it (or the server refuses).
async function readScope(scope, runId, key) {
  const query = new URLSearchParams({ run_id: runId, with_values: "true",
                                      page_size: String(MAX_KEYS) });
  const response = await fetch(`/v1/state/${scope}?${query}`, { headers: authHeaders() });
  if (response.status === 401 || response.status === 403) refusedKey = key;
  if (!response.ok) return null;
  return response.json();
}

// A read under way, and whether another was asked for meanwhile (the first event and the
// Result of a finished run come moments apart: one read follows the other, never both at
// once, so a refusal is known before the next one would be asked).
let reading = null;
let readAgain = false;

// Reads the shown run's run and tree state again and shows them (hidden when refused).
export function refreshRunState() {
  if (reading) {
    readAgain = true;
    return reading;
  }
  reading = (async () => {
    try {
      do {
        readAgain = false;
        await readRunState();
      } while (readAgain);
    } finally {
      reading = null;
    }
  })();
  return reading;
}

async function readRunState() {
  const runId = shown.runId;
  const root = rootRunId || runId;
  const key = savedToken();
  if (!runId || key === refusedKey) {
    $("state-box").hidden = true;
    return;
  }
  let run;
  let tree = null;
  try {
    run = await readScope("run", runId, key);
    if (run !== null) tree = await readScope("tree", root, key);
  } catch {
    return;  // the gateway is gone for now: the next refresh tries again
  }
  if (shown.runId !== runId) return;  // another run is shown by now
  $("state-box").hidden = run === null || tree === null;
  if (run === null || tree === null) return;
  $("state-tree-root").textContent = root;
  fill($("state-run-entries"), run);
  fill($("state-tree-entries"), tree);
}

// Fills a scope's box: a <dl> of its keys and values, or a line saying it is empty.
function fill(box, page) {
  const entries = page.entries || [];
  if (!entries.length) {
    box.replaceChildren(el("p", "help", "nothing kept"));
    return;
  }
  const list = el("dl");
  list.append(...entries.map((entry) => {
    const item = el("div");
    item.dataset.key = entry.key;
    // An entry listed but gone before its value was read has no "value".
    const text = "value" in entry ? JSON.stringify(entry.value) : "(expired)";
    item.append(el("dt", "", entry.key), el("dd", "", text));
    return item;
  }));
  box.replaceChildren(list);
  if (page.next_after_key) box.append(el("p", "help", `more than ${MAX_KEYS} keys`));
}
