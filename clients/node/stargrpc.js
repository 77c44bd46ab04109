// A small Node.js client of stargrpc, built from the contract in protos/ at run time with
// @grpc/proto-loader (no generated code to keep in step).
//
//   const { connect } = require("./stargrpc");
//
//   async function main() {
//     const client = connect("localhost:50051", { apiKey: process.env.STARGRPC_API_KEY });
//     const { tools } = await client.listTools();
//     for await (const event of client.execute("count", { to: 3 })) console.log(event);
//     client.close();
//   }
//   main();
//
// Events are plain objects in the proto3 JSON mapping (the same shape `stargrpc call --json`
// prints): enum names, 64-bit integers as strings, timestamps as RFC 3339 text, Structs as
// JSON objects. A stream that breaks after the run started is resumed with WatchRun from the
// last seq seen, so every event arrives exactly once and in order. A refused call rejects
// with the grpc-js error, its google.rpc details decoded onto it (see `withDetails`).
"use strict";

const crypto = require("node:crypto");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
// google/rpc/status.proto and error_details.proto (from googleapis), for the status details.
const RPC_PROTO_ROOT = path.resolve(__dirname, "protos");

// -- proto3 JSON for the well-known types -------------------------------------------------
// protobufjs applies these wrappers whenever it turns a message of that type into an
// object, at any depth; they must be registered before the contract is loaded.

function toNumber(value) {
  return typeof value === "object" && value !== null ? value.toNumber() : Number(value || 0);
}

function fraction(nanos) {
  if (!nanos) return "";
  const digits = String(nanos).padStart(9, "0");
  return "." + digits.replace(/(000)+$/, "");
}

// The contract is loaded with keepCase, so a decoded Value holds its field under the proto
// name (number_value); a Value made from an object by protobufjs, under the camelCase one.
// Own properties only: the prototype carries every field's default ("" for a string).
function field(value, camel, snake) {
  if (Object.prototype.hasOwnProperty.call(value, snake)) return value[snake];
  if (Object.prototype.hasOwnProperty.call(value, camel)) return value[camel];
  return undefined;
}

function structValue(value) {
  if (value === null || value === undefined) return null;
  const struct = field(value, "structValue", "struct_value");
  if (struct) return structObject(struct);
  const list = field(value, "listValue", "list_value");
  if (list) return (list.values || []).map(structValue);
  for (const [camel, snake] of [["stringValue", "string_value"], ["numberValue", "number_value"],
    ["boolValue", "bool_value"]]) {
    const found = field(value, camel, snake);
    if (found !== undefined && found !== null) return found;
  }
  return null;
}

function structObject(struct) {
  const out = {};
  for (const [key, value] of Object.entries(struct.fields || {})) out[key] = structValue(value);
  return out;
}

protobuf.wrappers[".google.protobuf.Timestamp"] = {
  fromObject(object) {
    return this.fromObject(object);
  },
  toObject(message) {
    const iso = new Date(toNumber(message.seconds) * 1000).toISOString();
    return iso.replace(".000Z", fraction(message.nanos) + "Z");
  },
};
protobuf.wrappers[".google.protobuf.Duration"] = {
  fromObject(object) {
    return this.fromObject(object);
  },
  toObject(message) {
    return `${toNumber(message.seconds)}${fraction(Math.abs(message.nanos || 0))}s`;
  },
};
protobuf.wrappers[".google.protobuf.Struct"] = {
  fromObject(object) {
    return this.fromObject(object);
  },
  toObject(message) {
    return structObject(message);
  },
};
protobuf.wrappers[".google.protobuf.Value"] = {
  fromObject(object) {
    return this.fromObject(object);
  },
  toObject(message) {
    return structValue(message);
  },
};

// -- the contract -------------------------------------------------------------------------

const definition = protoLoader.loadSync(["stargrpc/v1/tool_service.proto", "stargrpc/v1/state.proto"], {
  includeDirs: [PROTO_ROOT],
  keepCase: true, // proto field names, as the Python CLI prints them
  longs: String,
  enums: String,
  bytes: String,
  defaults: false,
  oneofs: false,
  json: true,
});
const { ToolService, RunStateService } = grpc.loadPackageDefinition(definition).stargrpc.v1;

/** The scopes of run state, by the names the Python client and CLI use. */
const STATE_SCOPES = ["run", "tree", "principal", "global"];

/**
 * The StateScopeRef of a run state call.
 * @param {string} scope "run", "tree", "principal" or "global"
 * @param {object} [options] { runId (scope run, or the tree's root run), principal }
 */
function stateScope(scope, options = {}) {
  if (!STATE_SCOPES.includes(scope)) {
    throw new TypeError(`no state scope ${JSON.stringify(scope)}: ${STATE_SCOPES.join(", ")}`);
  }
  return {
    scope: `STATE_SCOPE_${scope.toUpperCase()}`,
    run_id: options.runId || "",
    principal: options.principal || "",
  };
}

// -- google.rpc status details ------------------------------------------------------------

const rpcRoot = new protobuf.Root();
// google/protobuf/* are built into protobufjs; the rest are shipped beside this file.
rpcRoot.resolvePath = (origin, target) =>
  (target.startsWith("google/protobuf/") ? target : path.join(RPC_PROTO_ROOT, target));
rpcRoot.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], { keepCase: true });
const RPC_STATUS = rpcRoot.lookupType("google.rpc.Status");
const DETAIL_TYPES = Object.fromEntries(["ErrorInfo", "BadRequest", "RetryInfo"].map(
  (name) => [`google.rpc.${name}`, rpcRoot.lookupType(`google.rpc.${name}`)]));

/**
 * Decodes the google.rpc details of a failed call (the `grpc-status-details-bin` trailer)
 * onto the grpc-js error, and returns it:
 *   error.reason      ErrorInfo.reason, such as "CATALOG_STALE" or "RUN_FINISHED" ("" if none)
 *   error.errorInfo   { reason, domain, metadata } or null
 *   error.violations  [{ field, description }] from BadRequest
 *   error.retryDelay  seconds from RetryInfo, or null
 */
function withDetails(error) {
  if (!error || typeof error !== "object" || "violations" in error) return error;
  Object.assign(error, { reason: "", errorInfo: null, violations: [], retryDelay: null });
  const raw = error.metadata instanceof grpc.Metadata
    ? error.metadata.get("grpc-status-details-bin")[0] : undefined;
  if (!raw) return error;
  let status;
  try {
    status = RPC_STATUS.decode(raw);
  } catch {
    return error; // unreadable details: the code and message still say what happened
  }
  for (const detail of status.details || []) {
    const type = DETAIL_TYPES[detail.type_url.slice(detail.type_url.lastIndexOf("/") + 1)];
    if (!type) continue;
    let message;
    try {
      message = type.decode(detail.value);
    } catch {
      continue; // a detail that does not read is left out; the others still count
    }
    if (type.name === "ErrorInfo") {
      error.errorInfo = { reason: message.reason, domain: message.domain,
        metadata: { ...message.metadata } };
      error.reason = message.reason;
    } else if (type.name === "BadRequest") {
      error.violations = (message.field_violations || []).map(
        (v) => ({ field: v.field, description: v.description }));
    } else if (message.retry_delay) {
      error.retryDelay = toNumber(message.retry_delay.seconds) + (message.retry_delay.nanos || 0) / 1e9;
    }
  }
  return error;
}

/** The seq of the Result a RUN_FINISHED answer names; Infinity when it names none. */
function endedBy(error) {
  const seq = Number((error.errorInfo && error.errorInfo.metadata.last_seq) || NaN);
  return Number.isFinite(seq) ? seq : Infinity;
}

/** Codes on which a broken stream is resumed (the caller's own deadline is not one). */
const RESUMABLE = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.CANCELLED,
  grpc.status.UNKNOWN,
  grpc.status.INTERNAL,
  grpc.status.ABORTED,
  grpc.status.RESOURCE_EXHAUSTED,
]);

/** The longest RetryInfo delay waited for before another try, in seconds (as in Python and Go). */
const MAX_RETRY_DELAY = 60;

/**
 * Whether a call refused before its run started may be sent again: UNAVAILABLE, and
 * RESOURCE_EXHAUSTED when the server said when to come back (RetryInfo), except LANE_BUSY
 * (the caller's own maxWaitSeconds declined that wait).
 */
function retryable(error) {
  if (error.code === grpc.status.UNAVAILABLE) return true;
  return error.code === grpc.status.RESOURCE_EXHAUSTED && error.retryDelay !== null &&
    error.retryDelay !== undefined && error.reason !== "LANE_BUSY";
}

/** The channel's keepalive pings (see the constructor). */
const KEEPALIVE_TIME_MS = 20000;
const KEEPALIVE_TIMEOUT_MS = 10000;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Reads a server stream as an async iterator of events, ending with its status. */
async function* readStream(call) {
  try {
    for await (const response of call) yield response.event;
  } finally {
    call.cancel();
  }
}

class StargrpcClient {
  /**
   * @param {string} target host:port
   * @param {object} [options]
   * @param {string} [options.apiKey] API key or JWT, sent as `authorization: Bearer ...`
   * @param {boolean} [options.tls] use TLS (system roots, or options.caFile)
   * @param {Buffer} [options.caPem] PEM roots to verify the server with
   * @param {number} [options.maxAttempts] tries in a row before giving up (default 5)
   */
  constructor(target, options = {}) {
    const credentials = options.tls || options.caPem
      ? grpc.credentials.createSsl(options.caPem || null)
      : grpc.credentials.createInsecure();
    const channelOptions = {
      "grpc.primary_user_agent": "stargrpc-node/0.1.0",
      // While a call is open, ping after 20 s without news and take the connection for dead
      // when no answer comes within 10 s: a server that stopped answering (a stopped
      // process, a host gone silent, a network cut) would otherwise hold a stream for ever.
      // The call then fails UNAVAILABLE and a run's stream is resumed. A stargrpc server
      // accepts pings every 10 s.
      "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
      "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
    };
    this.stub = new ToolService(target, credentials, channelOptions);
    // RunStateService on the same channel (closed with it).
    this.stateStub = new RunStateService(target, credentials,
      { channelOverride: this.stub.getChannel() });
    this.apiKey = options.apiKey || "";
    this.maxAttempts = options.maxAttempts || 5;
  }

  metadata() {
    const metadata = new grpc.Metadata();
    if (this.apiKey) metadata.set("authorization", `Bearer ${this.apiKey}`);
    return metadata;
  }

  /** The catalog: `{ tools: [...], catalog_hash }`. */
  listTools() {
    return new Promise((resolve, reject) => {
      this.stub.ListTools({}, this.metadata(),
        (error, reply) => (error ? reject(withDetails(error)) : resolve(reply)));
    });
  }

  /** Asks a run to stop; resolves to whether it was still going. */
  cancelRun(runId, reason = "") {
    return new Promise((resolve, reject) => {
      this.stub.CancelRun({ run_id: runId, reason }, this.metadata(),
        (error, reply) => (error ? reject(withDetails(error)) : resolve(Boolean(reply.cancelled))));
    });
  }

  /**
   * Sends a steering message to a running tool (SteerRun); resolves to the run id. Not
   * retried: a retried steer could reach the tool twice.
   */
  steerRun(runId, message) {
    return new Promise((resolve, reject) => {
      this.stub.SteerRun({ run_id: runId, message }, this.metadata(),
        (error, reply) => (error ? reject(withDetails(error)) : resolve(reply.run_id)));
    });
  }

  /**
   * Approves (or, with `deny`, denies) a run that waits for approval (ApproveRun); needs
   * the server's approver role. Resolves to `{ run_id, decision, arguments_digest }`. Not
   * retried: a decision is taken once.
   * @param {string} runId
   * @param {string} approvalId the ApprovalRequest's approval_id
   * @param {object} [options] { deny, reason, argumentsDigest }
   */
  approveRun(runId, approvalId, options = {}) {
    const request = {
      run_id: runId,
      approval_id: approvalId,
      decision: options.deny ? "APPROVAL_VERDICT_DENY" : "APPROVAL_VERDICT_APPROVE",
      reason: options.reason || "",
      arguments_digest: options.argumentsDigest || "",
    };
    return new Promise((resolve, reject) => {
      this.stub.ApproveRun(request, this.metadata(),
        (error, reply) => (error ? reject(withDetails(error)) : resolve(reply)));
    });
  }

  /**
   * Opens a session (CreateSession): a sandbox kept across calls. Resolves to the Session
   * (`session_id`, `kind`, limits, `usage`). Not retried: a retry could open two.
   * @param {string} [kind] "python" (a live interpreter) or "shell"
   * @param {object} [limits] { ttl_seconds, idle_seconds, memory_mb, cpu_seconds, disk_mb }
   */
  createSession(kind = "python", limits = {}) {
    return new Promise((resolve, reject) => {
      this.stub.CreateSession({ kind, ...limits }, this.metadata(),
        (error, reply) => (error ? reject(withDetails(error)) : resolve(reply.session)));
    });
  }

  /** Closes one of the caller's sessions (CloseSession). */
  closeSession(sessionId) {
    return new Promise((resolve, reject) => {
      this.stub.CloseSession({ session_id: sessionId }, this.metadata(),
        (error) => (error ? reject(withDetails(error)) : resolve()));
    });
  }

  /** The caller's open sessions, with their running totals (ListSessions). */
  listSessions() {
    return new Promise((resolve, reject) => {
      this.stub.ListSessions({}, this.metadata(),
        (error, reply) => (error ? reject(withDetails(error)) : resolve(reply.sessions)));
    });
  }

  /** A unary call on `stub`, its refusal decoded (see `withDetails`). */
  unary(stub, method, request) {
    return new Promise((resolve, reject) => {
      stub[method](request, this.metadata(),
        (error, reply) => (error ? reject(withDetails(error)) : resolve(reply)));
    });
  }

  /**
   * The value of `key` in a scope of run state as its canonical JSON text, or null when
   * absent (GetState; admin role). Text, not a parsed value, so large integers keep every
   * digit; `getState` parses it.
   * @param {string} scope "run", "tree", "principal" or "global"
   * @param {string} key
   * @param {object} [options] { runId (scope run, or the tree's root run), principal }
   */
  async getStateJson(scope, key, options = {}) {
    const reply = await this.unary(this.stateStub, "GetState",
      { scope: stateScope(scope, options), key });
    return reply.found ? reply.value_json : null;
  }

  /**
   * The value of `key` in a scope of run state (parsed JSON), or `options.default`
   * (undefined) when absent; see `getStateJson`.
   */
  async getState(scope, key, options = {}) {
    const text = await this.getStateJson(scope, key, options);
    return text === null ? options.default : JSON.parse(text);
  }

  /**
   * Sets `key` in a scope of run state (SetState; admin role) to `value`, encoded as JSON,
   * or to the JSON text `options.valueJson` when given (sent as written, for exact numbers).
   * @param {object} [options] { runId, principal, ttlSeconds (0: as long as the scope), valueJson }
   */
  async setState(scope, key, value, options = {}) {
    const valueJson = options.valueJson !== undefined ? options.valueJson : JSON.stringify(value);
    if (valueJson === undefined) throw new TypeError(`the value of ${key} is not JSON`);
    await this.unary(this.stateStub, "SetState", {
      scope: stateScope(scope, options), key, value_json: valueJson,
      ttl_seconds: options.ttlSeconds || 0,
    });
  }

  /** Removes `key` from a scope of run state (DeleteState; admin role); whether it was there. */
  async deleteState(scope, key, options = {}) {
    const reply = await this.unary(this.stateStub, "DeleteState",
      { scope: stateScope(scope, options), key });
    return Boolean(reply.deleted);
  }

  /**
   * One page of the keys of a scope of run state, sorted (ListState; admin role); resolves
   * to `{ entries: [{ key, value_json }], next_after_key }` ("" when no key is left).
   * @param {object} [options] { runId, principal, prefix, pageSize (0: the server's
   *   default), afterKey (the previous page's next_after_key), withValues }
   */
  async listState(scope, options = {}) {
    const reply = await this.unary(this.stateStub, "ListState", {
      scope: stateScope(scope, options), prefix: options.prefix || "",
      page_size: options.pageSize || 0, after_key: options.afterKey || "",
      with_values: Boolean(options.withValues),
    });
    return {
      entries: (reply.entries || []).map((e) => ({ key: e.key, value_json: e.value_json || "" })),
      next_after_key: reply.next_after_key || "",
    };
  }

  /**
   * Runs a tool; yields its events, the last one carrying `result`.
   * @param {string} tool
   * @param {object} [args]
   * @param {object} [options] { idempotencyKey, parentRunId, sessionId, sessionNoWait, lane,
   *   priority, maxWaitSeconds } — parentRunId hangs the run under a run of the caller's own
   *   (a call tree): listed in its tree, cancelled with it; sessionId runs it in one of the
   *   caller's sessions; lane (needs the server's lane_override_role), priority in the
   *   lane's queue (0: the default), maxWaitSeconds (refuse with LANE_BUSY rather than wait
   *   longer; 0 waits)
   */
  async* execute(tool, args = {}, options = {}) {
    const request = {
      tool_name: tool,
      arguments_json: JSON.stringify(args),
      // Runs with a key outlive their stream, so a broken stream can be resumed.
      idempotency_key: options.idempotencyKey || crypto.randomUUID().replace(/-/g, ""),
      parent_run_id: options.parentRunId || "",
      session_id: options.sessionId || "",
      session_no_wait: Boolean(options.sessionNoWait),
      lane: options.lane || "",
      priority: options.priority || 0,
      max_wait_seconds: options.maxWaitSeconds || 0,
    };
    const cursor = { runId: "", lastSeq: 0, finished: false };
    for (let attempt = 1; ; attempt++) {
      let failure;
      try {
        const call = this.stub.Execute(request, this.metadata());
        for await (const event of this.fresh(readStream(call), cursor)) yield event;
        if (cursor.finished) return;
        if (cursor.runId) break; // ended without its Result: resume
        failure = new Error("the stream ended before the run started");
      } catch (error) {
        withDetails(error);
        if (cursor.runId) {
          if (!RESUMABLE.has(error.code)) throw error;
          break; // the run started: never run it again, resume it
        }
        if (!retryable(error)) throw error;
        failure = error;
      }
      if (attempt >= this.maxAttempts) throw failure;
      // Refused before the run started: the same key again, after the server's RetryInfo
      // delay when it sent one (one over MAX_RETRY_DELAY is the caller's to judge).
      const backoff = 100 * 2 ** (attempt - 1);
      if (failure.retryDelay !== null && failure.retryDelay !== undefined) {
        if (failure.retryDelay > MAX_RETRY_DELAY) throw failure;
        await sleep(Math.max(failure.retryDelay * 1000, backoff));
      } else {
        await sleep(backoff);
      }
    }
    yield* this.follow(cursor);
  }

  /**
   * Replays a run's events after `afterSeq`, then follows it until its Result. When the run
   * had already ended at or before `afterSeq` there is nothing to replay: it yields nothing
   * (the server answers OUT_OF_RANGE with reason RUN_FINISHED, which is the end).
   */
  async* watch(runId, afterSeq = 0) {
    yield* this.follow({ runId, lastSeq: Number(afterSeq), finished: false });
  }

  async* follow(cursor) {
    for (let attempt = 1; ; attempt++) {
      const request = { run_id: cursor.runId, after_seq: String(cursor.lastSeq) };
      let failure;
      try {
        for await (const event of this.fresh(readStream(this.stub.WatchRun(request, this.metadata())), cursor)) {
          attempt = 0;
          yield event;
        }
        if (cursor.finished) return;
        failure = new Error("the stream ended before the run's Result");
      } catch (error) {
        withDetails(error);
        if (error.reason === "RUN_FINISHED" && endedBy(error) <= cursor.lastSeq) {
          cursor.finished = true; // the run ended at or before what the caller has seen
          return;
        }
        if (!RESUMABLE.has(error.code)) throw error;
        failure = error;
      }
      if (attempt >= this.maxAttempts) {
        const error = new Error(`run ${cursor.runId} could not be resumed after ${attempt} ` +
          `tries: ${failure.details || failure.message}`);
        error.code = failure.code;
        throw error;
      }
      await sleep(50 * 2 ** attempt);
    }
  }

  /** Passes on only the events after the cursor; a gap is an error. */
  async* fresh(events, cursor) {
    for await (const event of events) {
      const seq = Number(event.seq);
      if (seq <= cursor.lastSeq) continue; // already seen (an attach replays from 1)
      if (seq !== cursor.lastSeq + 1) {
        throw new Error(`events ${cursor.lastSeq + 1}..${seq - 1} of run ${event.run_id} are missing`);
      }
      cursor.runId = event.run_id;
      cursor.lastSeq = seq;
      cursor.finished = event.result !== undefined;
      yield event;
      if (cursor.finished) return;
    }
  }

  close() {
    this.stub.close();
  }
}

/** A client of the stargrpc server at `target`. */
function connect(target, options) {
  return new StargrpcClient(target, options);
}

module.exports = { connect, StargrpcClient, withDetails, STATE_SCOPES };
