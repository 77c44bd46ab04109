// What more than one part of the page reads: the tool catalog, what the server offers,
// and the run shown. Each field says who writes it; everything else only reads.

// Tool name -> catalog entry (written by form.js when the tools are listed).
export const catalog = new Map();

// What the server offers (written once at start-up from GET /v1/capabilities).
export const server = { canSteer: false };

// The run shown (reset by stream.js when the page follows a run).
export const shown = {
  runId: null,        // its id (stream.js)
  finished: false,    // its Result has arrived (run-view.js)
  deadline: null,     // Date.now() value when the critic would stop it (stream.js)
  softTimeout: null,  // the critic's quiet period, in seconds (stream.js)
  runArgs: null,      // the arguments it was started with, when this tab started it (null
                      // again once another tool is chosen in the form)
  streamed: "",       // the stdout DELTA text it streamed, to show its output once (run-view.js)
  chunks: new Map(),  // file_id -> [Uint8Array] of streamed files (run-view.js)
};

export function showRun(runId, runArgs) {
  Object.assign(shown, { runId, finished: false, deadline: null, softTimeout: null, runArgs,
                         streamed: "" });
  shown.chunks.clear();
}
