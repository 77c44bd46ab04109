// The Node.js runner of the conformance suite (conformance/cases.json): runs every case with
// the client of ./stargrpc.js against one live server started with
// --tools-dir conformance/tools, prints "PASS name" or "FAIL name: why" per case, then
// "N passed, M failed", and exits 1 when a case failed.
//
//   node clients/node/conformance.js --target 127.0.0.1:50051 --api-key "$STARGRPC_API_KEY"
//
// Where the library has no option for what a case sends (raw arguments_json, a deadline,
// catalog_hash, coalesce_deltas) or a case reads a raw status (RUN_FINISHED), it uses the
// library's grpc-js stub (client.stub) and decodes refusals with withDetails.
"use strict";

const crypto = require("node:crypto");
const fs = require("node:fs");
const net = require("node:net");
const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const { connect, withDetails } = require("./stargrpc");

const CASE_TIMEOUT_MS = 60000;

class Failed extends Error {}

function check(condition, why) {
  if (!condition) throw new Failed(why);
}

const argumentsOf = (c) => c.arguments_json || JSON.stringify(c.arguments || {});
const newKey = () => crypto.randomUUID().replace(/-/g, "");
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function checkGapless(events) {
  events.forEach((e, i) => {
    check(Number(e.seq) === i + 1, `event ${i + 1} has seq ${e.seq}`);
    check(e.run_id === events[0].run_id, "events of more than one run");
  });
}

function checkEndsWithResult(events, outcome, output) {
  const results = events.flatMap((e, i) => (e.result ? [i] : []));
  check(results.length === 1 && results[0] === events.length - 1,
    `Results at ${results} of ${events.length} events`);
  const { result } = events[events.length - 1];
  check(result.outcome === outcome,
    `outcome ${result.outcome} (${result.error && result.error.code} ${result.error && result.error.message})`);
  if (output !== undefined) check(result.output === output, `output ${JSON.stringify(result.output)}`);
}

function checkRefused(error, code, reason) {
  check(error, "the call was not refused");
  check(error.code === code && error.reason === reason,
    `refused ${grpc.status[error.code]} [${error.reason}], not ${grpc.status[code]} [${reason}]`);
  return error;
}

/** A TCP proxy whose cut() closes every connection through it; it keeps accepting. */
function startProxy(target) {
  const [host, port] = [target.slice(0, target.lastIndexOf(":")), Number(target.slice(target.lastIndexOf(":") + 1))];
  const sockets = new Set();
  const proxy = { connections: 0 };
  const server = net.createServer((down) => {
    proxy.connections++;
    const up = net.connect(port, host);
    for (const socket of [down, up]) {
      sockets.add(socket);
      socket.on("error", () => {});
      socket.on("close", () => sockets.delete(socket));
    }
    down.pipe(up);
    up.pipe(down);
  });
  proxy.cut = () => { for (const socket of sockets) socket.destroy(); };
  proxy.close = () => { proxy.cut(); server.close(); };
  proxy.ready = new Promise((resolve) => server.listen(0, "127.0.0.1",
    () => resolve(`127.0.0.1:${server.address().port}`)));
  return proxy;
}

class Runner {
  constructor(target, apiKey) {
    this.target = target;
    this.apiKey = apiKey;
    this.client = connect(target, { apiKey });
  }

  async events(c, client = this.client, options = {}) {
    const events = [];
    for await (const event of client.execute(c.tool, c.arguments || {}, options)) events.push(event);
    return events;
  }

  async refusal(c, options) {
    try {
      await this.events(c, this.client, options);
    } catch (error) {
      return withDetails(error);
    }
    return null;
  }

  /** Every event of a raw Execute through the stub; a refusal rejects, details decoded. */
  raw(request, options = {}, onEvent = () => {}) {
    return new Promise((resolve, reject) => {
      const events = [];
      const call = this.client.stub.Execute(
        { idempotency_key: newKey(), ...request }, this.client.metadata(), options);
      call.on("data", (response) => { events.push(response.event); onEvent(events, call); });
      call.on("error", (error) => { error.events = events; reject(withDetails(error)); });
      call.on("end", () => resolve(events));
    });
  }

  async seq_gapless_from_1(c) {
    checkGapless(await this.events(c));
  }

  async steps_start_delta_end_nested(c) {
    const parents = new Map();
    const ended = new Set();
    const deltas = new Map();
    for (const e of await this.events(c)) {
      if (!e.step) continue;
      const { id, parent_id: parent = "" } = e.step.step;
      const started = parents.has(id);
      if (e.step.phase === "STEP_PHASE_START") {
        check(!started, `step ${id} started twice`);
        check(parents.size === 0 ? parent === "" : parents.has(parent) && !ended.has(parent),
          `step ${id} starts outside a running parent "${parent}"`);
        parents.set(id, parent);
      } else if (e.step.phase === "STEP_PHASE_DELTA") {
        check(started && !ended.has(id), `delta outside step ${id}`);
        deltas.set(id, [...(deltas.get(id) || []), e.step.delta]);
      } else {
        check(started && !ended.has(id), `step ${id} ends twice`);
        for (const [child, p] of parents) check(p !== id || ended.has(child), `step ${id} ends before its child ${child}`);
        check(e.step.step.status === "STEP_STATUS_COMPLETE", `step ${id} status`);
        ended.add(id);
      }
    }
    check(ended.size === parents.size, "a step never ended");
    const ids = [...parents.keys()];
    check(ids.slice(1).every((id) => parents.get(id) !== ""), "more than one top-level step");
    const inner = ids.find((id) => parents.get(id) && parents.get(parents.get(id)));
    check(inner, "no step nested two levels deep");
    check(JSON.stringify(deltas.get(inner)) === JSON.stringify(["1\n", "2\n", "3\n"]), "inner deltas");
  }

  async one_result_last(c) {
    checkEndsWithResult(await this.events(c), "OUTCOME_OK", "steps 3");
  }

  async bad_arguments_bad_request(c) {
    const error = checkRefused(await this.refusal(c), grpc.status.INVALID_ARGUMENT, "INVALID_ARGUMENT");
    check(error.violations.some((v) => v.field === "arguments.items"),
      `violations ${JSON.stringify(error.violations)}`);
  }

  async unknown_tool_not_found(c) {
    checkRefused(await this.refusal(c), grpc.status.NOT_FOUND, "TOOL_NOT_FOUND");
  }

  async stale_catalog_refused(c) {
    const refused = await this.raw({ tool_name: c.tool, arguments_json: argumentsOf(c),
      catalog_hash: c.catalog_hash }).then(() => null, (error) => error);
    checkRefused(refused, grpc.status.FAILED_PRECONDITION, "CATALOG_STALE");
  }

  async cancel_then_watch_shows_cancelled(c) {
    let runId;
    for await (const event of this.client.execute(c.tool, c.arguments)) {
      runId = event.run_id;
      break; // stop reading: the run, which has an idempotency key, goes on until:
    }
    await this.client.cancelRun(runId, "conformance: cancelled by the caller");
    const watched = [];
    for await (const event of this.client.watch(runId, 0)) watched.push(event);
    checkGapless(watched);
    checkEndsWithResult(watched, "OUTCOME_CANCELLED");
  }

  async resume_after_cut(c) {
    const proxy = startProxy(this.target);
    const client = connect(await proxy.ready, { apiKey: this.apiKey });
    const events = [];
    try {
      for await (const event of client.execute(c.tool, c.arguments)) {
        events.push(event);
        if (events.length === c.cut_after_events) proxy.cut();
      }
    } finally {
      client.close();
      proxy.close();
    }
    checkGapless(events);
    checkEndsWithResult(events, "OUTCOME_OK", "steps 6");
    check(proxy.connections > 1, "the client did not connect again after the cut");
  }

  async run_finished_past_the_end(c) {
    const events = await this.events(c);
    const last = events[events.length - 1];
    const refused = await new Promise((resolve) => {
      const call = this.client.stub.WatchRun({ run_id: last.run_id, after_seq: last.seq },
        this.client.metadata());
      call.on("data", () => {});
      call.on("error", (error) => resolve(withDetails(error)));
      call.on("end", () => resolve(null));
    });
    checkRefused(refused, grpc.status.OUT_OF_RANGE, "RUN_FINISHED");
    const { metadata } = refused.errorInfo;
    check(metadata.last_seq === String(last.seq) && metadata.outcome === "OUTCOME_OK",
      `metadata ${JSON.stringify(metadata)}`);
    const watched = [];
    for await (const event of this.client.watch(last.run_id, last.seq)) watched.push(event);
    check(watched.length === 0, `watch past the end delivered ${watched.length} events`);
  }

  async idempotent_attach_replay_reuse(c) {
    const idempotencyKey = newKey();
    const firstStream = this.client.execute(c.tool, c.arguments, { idempotencyKey });
    const first = [(await firstStream.next()).value];
    const attached = await this.events(c, this.client, { idempotencyKey });
    for await (const event of firstStream) first.push(event);
    const replayed = await this.events(c, this.client, { idempotencyKey });
    const shape = (events) => JSON.stringify(events.map((e) => [e.run_id, e.seq,
      Object.keys(e).find((k) => ["step", "heartbeat", "notice", "file_chunk", "result"].includes(k))]));
    checkEndsWithResult(first, "OUTCOME_OK");
    check(shape(attached) === shape(first), "the attached call saw other events");
    check(shape(replayed) === shape(first)
      && replayed[replayed.length - 1].result.output === first[first.length - 1].result.output,
    "the replay differs from the run");
    checkRefused(await this.refusal({ ...c, arguments: c.reuse_arguments }, { idempotencyKey }),
      grpc.status.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED");
  }

  async client_deadline_timeout(c) {
    // The library has no deadline option: the stub, with the deadline.
    let events = await this.raw({ tool_name: c.tool, arguments_json: argumentsOf(c) },
      { deadline: Date.now() + c.deadline_seconds * 1000 }).catch((error) => {
      check(error.code === grpc.status.DEADLINE_EXCEEDED, `ended with ${error.message}`);
      return error.events;
    });
    check(events.length > 0, "no event before the deadline");
    if (!events[events.length - 1].result) {
      const runId = events[0].run_id;
      events = [];
      for await (const event of this.client.watch(runId, 0)) events.push(event);
    }
    checkEndsWithResult(events, "OUTCOME_TIMEOUT");
    const { code } = events[events.length - 1].result.error;
    check(code === "CLIENT_DEADLINE", `code ${code}`);
  }

  async chunked_file_sha256(c) {
    const events = await this.events(c);
    checkEndsWithResult(events, "OUTCOME_OK");
    const chunks = events.filter((e) => e.file_chunk).map((e) => e.file_chunk);
    check(chunks.length > 1, `${chunks.length} chunks`);
    let offset = 0;
    const parts = [];
    chunks.forEach((chunk, i) => {
      check(Number(chunk.offset || 0) === offset, `chunk at ${chunk.offset}, expected ${offset}`);
      check(Boolean(chunk.last) === (i === chunks.length - 1), "last flags");
      const data = Buffer.from(chunk.data || "", "base64");
      parts.push(data);
      offset += data.length;
    });
    const digest = crypto.createHash("sha256").update(Buffer.concat(parts)).digest("hex");
    const { result } = events[events.length - 1];
    const sent = (result.writeback && result.writeback.sent_files) || [];
    const size = c.arguments.size;
    check(sent.length === 1 && sent[0].streamed && Number(sent[0].size) === size && offset === size,
      `sent files ${JSON.stringify(sent.map((f) => [f.name, f.size, f.streamed]))}, ${offset} bytes`);
    check(sent[0].sha256 === digest && result.output === digest, "sha256 differs");
  }

  async coalesced_deltas_gapless(c) {
    // The library has no coalesce_deltas option: the stub, paused after the first event.
    const events = await this.raw({ tool_name: c.tool, arguments_json: argumentsOf(c),
      coalesce_deltas: true }, {}, (seen, call) => {
      if (seen.length === 1) {
        call.pause();
        setTimeout(() => call.resume(), c.pause_seconds * 1000);
      }
    });
    let last = 0;
    let text = "";
    for (const e of events) {
      const first = Number(e.first_seq || e.seq);
      check(first === last + 1 && Number(e.seq) >= first, `message ${first}..${e.seq} after seq ${last}`);
      last = Number(e.seq);
      if (e.step && e.step.phase === "STEP_PHASE_DELTA") text += e.step.delta;
    }
    const { count } = c.arguments;
    check(text === Array.from({ length: count }, (_, i) => `${i + 1}\n`).join(""), "the delta texts differ");
    check(events.some((e) => Number(e.first_seq || 0) > 0), "no message was coalesced");
    checkEndsWithResult(events, "OUTCOME_OK", `burst ${count}`);
  }

  async big_integer_arguments_json(c) {
    // JSON.stringify cannot write the number exactly: the raw text goes through the stub.
    const events = await this.raw({ tool_name: c.tool, arguments_json: c.arguments_json });
    checkEndsWithResult(events, "OUTCOME_OK", c.output);
  }
}

/** A failure as one line: a refusal's code, message and reason, else the message. */
function describe(error) {
  if (error && typeof error.code === "number" && grpc.status[error.code] !== undefined) {
    withDetails(error);
    return `${grpc.status[error.code]}: ${error.details}${error.reason ? ` [${error.reason}]` : ""}`;
  }
  return String((error && error.message) || error);
}

async function main() {
  const { values } = parseArgs({
    options: {
      target: { type: "string", default: process.env.STARGRPC_TARGET || "localhost:50051" },
      "api-key": { type: "string", default: process.env.STARGRPC_API_KEY || "" },
      cases: { type: "string",
        default: path.resolve(__dirname, "..", "..", "conformance", "cases.json") },
    },
  });
  const { cases } = JSON.parse(fs.readFileSync(values.cases, "utf8"));
  const runner = new Runner(values.target, values["api-key"]);
  let failed = 0;
  for (const c of cases) {
    let timer;
    try {
      check(typeof runner[c.name] === "function", "not implemented by this runner");
      await Promise.race([runner[c.name](c), new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Failed("timed out")), CASE_TIMEOUT_MS);
      })]);
      console.log(`PASS ${c.name}`);
    } catch (error) {
      failed++;
      console.log(`FAIL ${c.name}: ${describe(error).split(/\s+/).join(" ")}`);
    } finally {
      clearTimeout(timer);
    }
  }
  runner.client.close();
  console.log(`${cases.length - failed} passed, ${failed} failed`);
  process.exitCode = failed ? 1 : 0;
}

main();
