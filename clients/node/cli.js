#!/usr/bin/env node
// The Node.js client from a shell:
//
//   node clients/node/cli.js tools                          list the catalog
//   node clients/node/cli.js call count '{"to": 3}'         run a tool, events as they stream
//   node clients/node/cli.js watch RUN_ID --after-seq 2     replay + follow a run
//
// Options: --target HOST:PORT (env STARGRPC_TARGET, default localhost:50051), --api-key KEY
// (env STARGRPC_API_KEY), --tls, --ca-file PEM, --json (one event per line, proto3 JSON).
// `call` and `watch` exit 0 only when the outcome is OK, like `stargrpc call`.
"use strict";

const fs = require("node:fs");
const { parseArgs } = require("node:util");
const { connect } = require("./stargrpc");

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

function render(event, asJson, depth) {
  if (asJson) {
    process.stdout.write(JSON.stringify(event) + "\n");
    return;
  }
  if (event.step) {
    const { phase, step, delta } = event.step;
    if (phase === "STEP_PHASE_START") {
      depth.set(step.id, (depth.get(step.parent_id || "") ?? -1) + 1);
      console.log(`${"  ".repeat(depth.get(step.id))}▶ ${step.title}`);
    } else if (phase === "STEP_PHASE_DELTA") {
      process.stdout.write(delta || "");
    } else if (phase === "STEP_PHASE_END") {
      const mark = step.status === "STEP_STATUS_COMPLETE" ? "✓" : "✗";
      console.log(`${"  ".repeat(depth.get(step.id) || 0)}${mark} ${step.title}`);
    }
  } else if (event.heartbeat) {
    console.log(`· ${event.heartbeat.message || "alive"}`);
  } else if (event.notice) {
    console.log(`! ${event.notice.message}`);
  } else if (event.result) {
    const { outcome, output, error } = event.result;
    console.log(`= ${outcome.replace("OUTCOME_", "")}`);
    if (output) console.log(output);
    if (error) console.log(`error ${error.code}: ${error.message}`);
  }
}

async function follow(events, asJson) {
  const depth = new Map();
  let outcome;
  for await (const event of events) {
    render(event, asJson, depth);
    if (event.result) outcome = event.result.outcome;
  }
  return outcome === undefined ? 1 : EXIT_CODES[outcome] ?? 1;
}

const USAGE = "usage: cli.js tools | call TOOL [ARGS_JSON] | watch RUN_ID [--after-seq N]\n" +
  "options: --target HOST:PORT  --api-key KEY  --tls  --ca-file PEM  --json  --idempotency-key K";

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
        for (const tool of catalog.tools) console.log(`${tool.name}  ${tool.description || ""}`);
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
      return await follow(client.execute(rest[0], args,
        { idempotencyKey: values["idempotency-key"] }), values.json);
    }
    if (command === "watch" && rest.length === 1) {
      return await follow(client.watch(rest[0], values["after-seq"]), values.json);
    }
    console.error(USAGE);
    return 2;
  } finally {
    client.close();
  }
}

main(process.argv.slice(2)).then(
  (code) => { process.exitCode = code; },
  (error) => {
    if (error instanceof UsageError) {
      console.error(`error: ${error.message}\n${USAGE}`);
      process.exitCode = 2;
      return;
    }
    // A gRPC status: its code name and message, like `stargrpc call`.
    const name = error.code !== undefined
      ? Object.keys(require("@grpc/grpc-js").status).find((k) => require("@grpc/grpc-js").status[k] === error.code)
      : "ERROR";
    console.error(`error: ${name}: ${error.details || error.message}`);
    process.exitCode = 1;
  },
);
