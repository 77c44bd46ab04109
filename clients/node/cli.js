#!/usr/bin/env node
// The Node.js client from a shell:
//
//   node clients/node/cli.js tools                          list the catalog
//   node clients/node/cli.js call count '{"to": 3}'         run a tool, events as they stream
//   node clients/node/cli.js watch RUN_ID --after-seq 2     replay + follow a run
//   node clients/node/cli.js cancel RUN_ID --reason "why"   stop a run
//   node clients/node/cli.js steer RUN_ID "message"          steer a running tool
//   node clients/node/cli.js approve RUN_ID --approval-id ID [--reason TEXT]
//   node clients/node/cli.js deny RUN_ID --approval-id ID [--reason TEXT]
//                                                           decide on a waiting run
//
//   node clients/node/cli.js session create python            open a session (prints its id)
//   node clients/node/cli.js call python '{"code":"x=1"}' --session ID   run in it
//
//   node clients/node/cli.js state get --scope run --run RUN_ID KEY    run state (admin role)
//   node clients/node/cli.js state set --scope global KEY '{"json": 1}' [--ttl SECONDS]
//   node clients/node/cli.js state delete --scope principal --principal ID KEY
//   node clients/node/cli.js state list --scope tree --run ROOT_ID [--prefix P] [--values]
//                                       [--limit N] [--after KEY]
//   (as `stargrpc state`: get prints the value's JSON, get and delete exit 3 when the key
//   is absent, list prints a key a line (KEY<TAB>JSON with --values) and where the next
//   page starts on stderr)
// Options: --target HOST:PORT (env STARGRPC_TARGET, default localhost:50051), --api-key KEY
// (env STARGRPC_API_KEY), --tls, --ca-file PEM, --json (one event per line, proto3 JSON).
// `call` and `watch` exit 0 only when the outcome is OK, like `stargrpc call`; `watch` past
// the end of a finished run has nothing to show and exits 0. Ctrl-C during `call` cancels
// the run and exits 130.
"use strict";

const fs = require("node:fs");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const { connect, STATE_SCOPES } = require("./stargrpc");

// A reader that stops early (`| head`) closes the pipe: end quietly, as shell tools do,
// instead of dying on an unhandled EPIPE (the stream is cancelled with the process).
process.stdout.on("error", (err) => {
  if (err.code === "EPIPE") process.exit(0);
  throw err;
});

const EXIT_CODES = {
  OUTCOME_OK: 0, OUTCOME_DENIED: 3, OUTCOME_FAILED: 4, OUTCOME_ERROR: 5,
  OUTCOME_TIMEOUT: 6, OUTCOME_CANCELLED: 7,
};
const EXIT_INTERRUPTED = 130;
/** How long Ctrl-C waits for a run id (the run's first event) and for CancelRun. */
const CANCEL_WAIT_MS = 5000;

class Renderer {
  constructor(asJson) {
    this.asJson = asJson;
    this.depth = new Map();
    this.streamed = ""; // the text of every DELTA shown, stderr aside
    this.midLine = false; // the last DELTA shown did not end its line
  }

  /** Writes a whole line, first ending a DELTA's unfinished one. */
  line(text) {
    if (this.midLine) process.stdout.write("\n");
    this.midLine = false;
    console.log(text);
  }

  render(event) {
    if (this.asJson) {
      process.stdout.write(JSON.stringify(event) + "\n");
      return;
    }
    if (event.step) {
      const { phase, step, delta, channel } = event.step;
      if (phase === "STEP_PHASE_START") {
        this.depth.set(step.id, (this.depth.get(step.parent_id || "") ?? -1) + 1);
        this.line(`${"  ".repeat(this.depth.get(step.id))}▶ ${step.title}`);
      } else if (phase === "STEP_PHASE_DELTA") {
        if (channel !== "stderr") this.streamed += delta || "";
        process.stdout.write(delta || "");
        if (delta) this.midLine = !delta.endsWith("\n");
      } else if (phase === "STEP_PHASE_END") {
        const mark = step.status === "STEP_STATUS_COMPLETE" ? "✓" : "✗";
        this.line(`${"  ".repeat(this.depth.get(step.id) || 0)}${mark} ${step.title}`);
      }
    } else if (event.heartbeat) {
      this.line(`· ${event.heartbeat.message || "alive"}`);
    } else if (event.notice) {
      this.line(`! ${event.notice.message}`);
    } else if (event.result) {
      const { outcome, output, error, usage } = event.result;
      if (usage) this.line(usageLine(usage)); // the receipt, just above the outcome
      this.line(`= ${outcome.replace("OUTCOME_", "")}`);
      const unseen = this.notStreamed(output || "");
      if (unseen) console.log(unseen);
      if (error) console.log(`error ${error.code}: ${error.message}`);
    }
  }

  /** The part of the output not already shown as deltas (as `stargrpc call` does). */
  notStreamed(output) {
    const streamed = this.streamed.replace(/\n+$/, "");
    if (streamed && output.startsWith(streamed)) {
      const rest = output.slice(streamed.length);
      if (!rest || rest.startsWith("\n")) return rest.replace(/^\n+|\n+$/g, "");
    }
    return output;
  }
}

/**
 * The run's receipt (Result.usage) on one line, as `stargrpc call` prints it: what was
 * measured, nothing for what was not (an unset field is absent from the object).
 */
function usageLine(usage) {
  const has = (name) => usage[name] !== undefined && usage[name] !== null;
  const num = (name) => Number(usage[name] || 0); // 64-bit integers arrive as strings
  const parts = [];
  if (has("wall_seconds")) parts.push(`wall ${seconds(num("wall_seconds"))}`);
  if (num("queued_seconds")) parts.push(`queued ${seconds(num("queued_seconds"))}`);
  if (has("cpu_user_seconds") || has("cpu_system_seconds")) {
    const user = num("cpu_user_seconds");
    const system = num("cpu_system_seconds");
    parts.push(`cpu ${seconds(user + system)} (${seconds(user)} user + ` +
               `${seconds(system)} system)`);
  }
  if (has("peak_rss_bytes")) parts.push(`peak memory ${size(num("peak_rss_bytes"))}`);
  if (has("bytes_written")) parts.push(`wrote ${size(num("bytes_written"))}`);
  if (has("network_bytes_sent") || has("network_bytes_received")) {
    parts.push(`network ${size(num("network_bytes_sent"))} sent, ` +
               `${size(num("network_bytes_received"))} received`);
  }
  if (num("child_runs")) parts.push(`${num("child_runs")} child runs`);
  return `usage: ${parts.join(", ")}`;
}

/** A duration for people, as `stargrpc call` shows it: 1.50s; under 10 ms in ms (0.4ms). */
function seconds(value) {
  if (!(value > 0)) return "0s";
  if (value < 0.01) return `${(value * 1000).toFixed(1)}ms`;
  return `${value.toFixed(2)}s`;
}

/** `count` bytes for people: 512 B, 12.0 KiB, 58.0 MiB, 1.5 GiB. */
function size(count) {
  if (count < 1024) return `${count} B`;
  let value = count;
  let unit = "B";
  for (unit of ["KiB", "MiB", "GiB"]) {
    value /= 1024;
    if (value < 1024) break;
  }
  return `${value.toFixed(1)} ${unit}`;
}

/**
 * Renders a stream of events and resolves to the exit status of its outcome. `run.id` is
 * set from the first event (and `run.started` resolved with it); `pastEnd` is said when
 * the stream ends without a Result (a watch past the end of a finished run).
 */
async function follow(events, asJson, run, pastEnd = "") {
  const renderer = new Renderer(asJson);
  let outcome;
  for await (const event of events) {
    if (!run.id) {
      run.id = event.run_id;
      run.start(run.id);
      if (!asJson) console.error(`run ${run.id}`);
    }
    renderer.render(event);
    if (event.result) outcome = event.result.outcome;
  }
  if (outcome === undefined && pastEnd) {
    console.error(pastEnd);
    return 0;
  }
  return outcome === undefined ? 1 : EXIT_CODES[outcome] ?? 1;
}

function newRun() {
  const run = { id: "" };
  run.started = new Promise((resolve) => { run.start = resolve; });
  return run;
}

const timeout = (ms, value) => new Promise((resolve) => setTimeout(resolve, ms, value).unref());

/**
 * Runs `call` and on Ctrl-C cancels its run (a run with an idempotency key would otherwise
 * go on without its stream) and resolves to 130. A second Ctrl-C leaves at once.
 */
async function callCancellingOnInterrupt(client, streamed, run) {
  let onInterrupt;
  const interrupted = new Promise((resolve) => {
    onInterrupt = () => resolve(true);
    process.once("SIGINT", onInterrupt);
  });
  streamed.catch(() => {}); // after Ctrl-C its end no longer matters
  const first = await Promise.race([streamed, interrupted]);
  if (first !== true) {
    process.removeListener("SIGINT", onInterrupt);
    return first;
  }
  process.once("SIGINT", () => process.exit(EXIT_INTERRUPTED));
  // Before its first event the run's id is not known yet: wait for it, briefly.
  const runId = run.id || await Promise.race([run.started, timeout(CANCEL_WAIT_MS, "")]);
  if (!runId) {
    console.error("interrupted before the run started");
    return EXIT_INTERRUPTED;
  }
  try {
    const stopped = await Promise.race([
      client.cancelRun(runId, "interrupted from the command line"),
      timeout(CANCEL_WAIT_MS).then(() => { throw new Error("no answer to CancelRun"); }),
    ]);
    console.error(stopped ? `interrupted; run ${runId} cancelled`
      : `interrupted; run ${runId} had already ended`);
  } catch (error) {
    console.error(`interrupted; run ${runId} could not be cancelled: ${error.details || error.message}`);
  }
  return EXIT_INTERRUPTED;
}

const USAGE = "usage: cli.js tools | call TOOL [ARGS_JSON] [--session ID] [--lane NAME] [--priority N] [--max-wait SECONDS] | " +
  "watch RUN_ID [--after-seq N] | " +
  "cancel RUN_ID [--reason TEXT]\n" +
  "steer RUN_ID MESSAGE | approve|deny RUN_ID --approval-id ID [--reason TEXT]\n" +
  "session create [python|shell] | session list | session close ID\n" +
  "state get|delete --scope S [--run ID] [--principal ID] KEY | state set ... KEY JSON [--ttl SECONDS]\n" +
  "state list --scope S [--run ID] [--principal ID] [--prefix P] [--values] [--limit N] [--after KEY]\n" +
  "options: --target HOST:PORT  --api-key KEY  --tls  --ca-file PEM  --json  --idempotency-key K  --parent-run-id RUN_ID  --session ID";

class UsageError extends Error {}

async function main(argv) {
  let parsed;
  try {
    parsed = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        target: { type: "string", default: process.env.STARGRPC_TARGET || "localhost:50051" },
        "api-key": { type: "string", default: process.env.STARGRPC_API_KEY || "" },
        tls: { type: "boolean", default: false },
        "ca-file": { type: "string" },
        json: { type: "boolean", default: false },
        "after-seq": { type: "string", default: "0" },
        "idempotency-key": { type: "string" },
        "parent-run-id": { type: "string" },
        session: { type: "string", default: "" },
        lane: { type: "string", default: "" },
        priority: { type: "string", default: "0" },
        "max-wait": { type: "string", default: "0" },
        reason: { type: "string", default: "" },
        "approval-id": { type: "string", default: "" },
        "arguments-digest": { type: "string", default: "" },
        scope: { type: "string", default: "" },
        run: { type: "string", default: "" },
        principal: { type: "string", default: "" },
        ttl: { type: "string" },
        prefix: { type: "string", default: "" },
        values: { type: "boolean", default: false },
        limit: { type: "string", default: "100" },
        after: { type: "string", default: "" },
        help: { type: "boolean", short: "h", default: false },
      },
    });
  } catch (error) {
    throw new UsageError(error.message);
  }
  const { values, positionals } = parsed;
  if (values.help) {
    console.log(USAGE);
    return 0;
  }
  const [command, ...rest] = positionals;
  const client = connect(values.target, {
    apiKey: values["api-key"],
    tls: values.tls,
    caPem: values["ca-file"] ? fs.readFileSync(values["ca-file"]) : undefined,
  });
  try {
    if (command === "tools") {
      const catalog = await client.listTools();
      if (values.json) {
        console.log(JSON.stringify(catalog, null, 2));
      } else {
        const width = Math.max(4, ...catalog.tools.map((tool) => tool.name.length));
        for (const tool of catalog.tools) {
          const permissions = tool.permissions || {};
          const flags = (permissions.privileged ? " [privileged]" : "") +
            (permissions.callable ? "" : " [not allowed]");
          console.log(`${tool.name.padEnd(width)}  ${tool.description || ""}${flags}`);
        }
        console.error(`catalog ${catalog.catalog_hash}`);
      }
      return 0;
    }
    if (command === "call" && rest.length >= 1) {
      let args = {};
      try {
        args = rest[1] ? JSON.parse(rest[1]) : {};
      } catch (error) {
        throw new UsageError(`ARGS_JSON is not valid JSON: ${error.message}`);
      }
      const priority = Number(values.priority);
      if (!/^-?\d{1,10}$/.test(values.priority) || Math.abs(priority) > 2 ** 31 - 1) {
        throw new UsageError("--priority must be a whole number (0: the default)");
      }
      const maxWaitSeconds = Number(values["max-wait"]);
      if (values["max-wait"].trim() === "" || !Number.isFinite(maxWaitSeconds)) {
        throw new UsageError("--max-wait must be a number of seconds (0 waits)");
      }
      const run = newRun();
      const streamed = follow(client.execute(rest[0], args,
        { idempotencyKey: values["idempotency-key"], parentRunId: values["parent-run-id"],
          sessionId: values.session, lane: values.lane, priority, maxWaitSeconds }),
        values.json, run);
      return await callCancellingOnInterrupt(client, streamed, run);
    }
    if (command === "session" && rest[0] === "create" && rest.length <= 2) {
      const session = await client.createSession(rest[1] || "python");
      console.log(values.json ? JSON.stringify(session) : session.session_id);
      return 0;
    }
    if (command === "session" && rest[0] === "list" && rest.length === 1) {
      for (const session of await client.listSessions()) {
        console.log(values.json ? JSON.stringify(session)
          : `${session.session_id}  ${session.kind}  ${session.busy ? "busy" : "idle"}  ${session.calls} calls`);
      }
      return 0;
    }
    if (command === "session" && rest[0] === "close" && rest.length === 2) {
      await client.closeSession(rest[1]);
      console.error("closed");
      return 0;
    }
    if (command === "state") return await stateCommand(client, rest, values);
    if (command === "watch" && rest.length === 1) {
      if (!/^\d+$/.test(values["after-seq"])) throw new UsageError("--after-seq must be a seq (a whole number >= 0)");
      return await follow(client.watch(rest[0], values["after-seq"]), values.json, newRun(),
        `run ${rest[0]} has ended: nothing follows seq ${values["after-seq"]}`);
    }
    if (command === "steer" && rest.length === 2) {
      await client.steerRun(rest[0], rest[1]);
      console.error("steered");
      return 0;
    }
    if ((command === "approve" || command === "deny") && rest.length === 1) {
      const reply = await client.approveRun(rest[0], values["approval-id"], {
        deny: command === "deny", reason: values.reason,
        argumentsDigest: values["arguments-digest"],
      });
      console.error(`${command === "deny" ? "denied" : "approved"} run ${reply.run_id}`);
      return 0;
    }
    if (command === "cancel" && rest.length === 1) {
      const stopped = await client.cancelRun(rest[0], values.reason);
      console.error(stopped ? "cancelled" : "already ended");
      return stopped ? 0 : 2;
    }
    console.error(USAGE);
    return 2;
  } finally {
    client.close();
  }
}

/** Where a state command reads or writes: --scope, with --run or --principal as it needs. */
function stateWhere(values) {
  const { scope, run, principal } = values;
  if (!STATE_SCOPES.includes(scope)) {
    throw new UsageError(`--scope must be one of ${STATE_SCOPES.join(", ")}`);
  }
  if ((scope === "run" || scope === "tree") && !run) throw new UsageError(`--scope ${scope} needs --run RUN_ID`);
  if (scope === "principal" && !principal) throw new UsageError("--scope principal needs --principal ID");
  return { scope, options: { runId: run, principal } };
}

/** `state get|set|delete|list`, as `stargrpc state`; resolves to the exit status. */
async function stateCommand(client, rest, values) {
  const [action, ...params] = rest;
  const arity = { get: 1, set: 2, delete: 1, list: 0 }[action];
  if (arity === undefined || params.length !== arity) throw new UsageError(`state ${action || ""}: wrong arguments`);
  const { scope, options } = stateWhere(values);
  if (action === "get") {
    const text = await client.getStateJson(scope, params[0], options);
    if (text === null) {
      console.error(`${params[0]}: absent`);
      return 3;
    }
    console.log(text);
    return 0;
  }
  if (action === "set") {
    try {
      JSON.parse(params[1]);
    } catch (error) {
      throw new UsageError(`VALUE is not JSON (${error.message}); quote a string as '"text"'`);
    }
    const ttlSeconds = values.ttl === undefined ? 0 : Number(values.ttl);
    if (!(ttlSeconds > 0) && values.ttl !== undefined) throw new UsageError("--ttl must be a number of seconds > 0");
    // The text goes as written, so a large integer keeps every digit.
    await client.setState(scope, params[0], undefined, { ...options, ttlSeconds, valueJson: params[1] });
    return 0;
  }
  if (action === "delete") {
    if (await client.deleteState(scope, params[0], options)) return 0;
    console.error(`${params[0]}: absent`);
    return 3;
  }
  const pageSize = Number(values.limit);
  if (!Number.isInteger(pageSize) || pageSize < 1 || pageSize > 1000) throw new UsageError("--limit must be 1..1000");
  const page = await client.listState(scope, { ...options, prefix: values.prefix, pageSize,
    afterKey: values.after, withValues: values.values });
  for (const entry of page.entries) console.log(values.values ? `${entry.key}\t${entry.value_json}` : entry.key);
  if (page.next_after_key) console.error(`more: --after ${page.next_after_key}`);
  return 0;
}

/** A failed call as `stargrpc call` shows it: code, message, reason, bad fields. */
function describeError(error) {
  const name = error.code !== undefined
    ? Object.keys(grpc.status).find((key) => grpc.status[key] === error.code) : "ERROR";
  const lines = [`error: ${name}: ${error.details || error.message}${error.reason ? ` [${error.reason}]` : ""}`];
  for (const violation of error.violations || []) {
    lines.push(`  ${violation.field}: ${violation.description}`);
  }
  // A LANE_BUSY refusal's is the estimated wait in the lane's queue.
  if (error.retryDelay !== null && error.retryDelay !== undefined) {
    lines.push(`  retry after ${error.retryDelay}s`);
  }
  return lines.join("\n");
}

main(process.argv.slice(2)).then(
  (code) => { process.exitCode = code; },
  (error) => {
    if (error instanceof UsageError) {
      console.error(`error: ${error.message}\n${USAGE}`);
      process.exitCode = 2;
      return;
    }
    console.error(describeError(error));
    process.exitCode = 1;
  },
);
