// A small Node.js client of stargrpc, built from the contract in protos/ at run time with
// @grpc/proto-loader (no generated code to keep in step).
//
//   const { connect } = require("./stargrpc");
//   const client = connect("localhost:50051", { apiKey: process.env.STARGRPC_API_KEY });
//   const { tools } = await client.listTools();
//   for await (const event of client.execute("count", { to: 3 })) console.log(event);
//
// Events are plain objects in the proto3 JSON mapping (the same shape `stargrpc call --json`
// prints): enum names, 64-bit integers as strings, timestamps as RFC 3339 text, Structs as
// JSON objects. A stream that breaks after the run started is resumed with WatchRun from the
// last seq seen, so every event arrives exactly once and in order.
"use strict";

const crypto = require("node:crypto");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");

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

function structValue(value) {
  if (value === null || value === undefined) return null;
  if (value.structValue) return structObject(value.structValue);
  if (value.listValue) return (value.listValue.values || []).map(structValue);
  if ("stringValue" in value && value.stringValue !== undefined) return value.stringValue;
  if ("numberValue" in value && value.numberValue !== undefined) return value.numberValue;
  if ("boolValue" in value && value.boolValue !== undefined) return value.boolValue;
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

const definition = protoLoader.loadSync("stargrpc/v1/tool_service.proto", {
  includeDirs: [PROTO_ROOT],
  keepCase: true, // proto field names, as the Python CLI prints them
  longs: String,
  enums: String,
  bytes: String,
  defaults: false,
  oneofs: false,
  json: true,
});
const { ToolService } = grpc.loadPackageDefinition(definition).stargrpc.v1;

/** Codes on which a broken stream is resumed (the caller's own deadline is not one). */
const RESUMABLE = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.CANCELLED,
  grpc.status.UNKNOWN,
  grpc.status.INTERNAL,
  grpc.status.ABORTED,
  grpc.status.RESOURCE_EXHAUSTED,
]);

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
    this.stub = new ToolService(target, credentials, {
      "grpc.primary_user_agent": "stargrpc-node/0.1.0",
    });
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
      this.stub.ListTools({}, this.metadata(), (error, reply) => (error ? reject(error) : resolve(reply)));
    });
  }

  /** Asks a run to stop; resolves to whether it was still going. */
  cancelRun(runId, reason = "") {
    return new Promise((resolve, reject) => {
      this.stub.CancelRun({ run_id: runId, reason }, this.metadata(),
        (error, reply) => (error ? reject(error) : resolve(Boolean(reply.cancelled))));
    });
  }

  /**
   * Runs a tool; yields its events, the last one carrying `result`.
   * @param {string} tool
   * @param {object} [args]
   * @param {object} [options] { idempotencyKey }
   */
  async* execute(tool, args = {}, options = {}) {
    const request = {
      tool_name: tool,
      arguments_json: JSON.stringify(args),
      // Runs with a key outlive their stream, so a broken stream can be resumed.
      idempotency_key: options.idempotencyKey || crypto.randomUUID().replace(/-/g, ""),
    };
    const cursor = { runId: "", lastSeq: 0, finished: false };
    for (let attempt = 1; ; attempt++) {
      try {
        const call = this.stub.Execute(request, this.metadata());
        for await (const event of this.fresh(readStream(call), cursor)) yield event;
        if (cursor.finished) return;
        if (cursor.runId) break; // ended without its Result: resume
      } catch (error) {
        if (cursor.runId) {
          if (!RESUMABLE.has(error.code)) throw error;
          break; // the run started: never run it again, resume it
        }
        if (error.code !== grpc.status.UNAVAILABLE || attempt >= this.maxAttempts) throw error;
      }
      await sleep(100 * 2 ** (attempt - 1)); // refused before the run started: same key again
    }
    yield* this.follow(cursor);
  }

  /** Replays a run's events after `afterSeq`, then follows it until its Result. */
  async* watch(runId, afterSeq = 0) {
    yield* this.follow({ runId, lastSeq: Number(afterSeq), finished: false });
  }

  async* follow(cursor) {
    for (let attempt = 1; ; attempt++) {
      const request = { run_id: cursor.runId, after_seq: String(cursor.lastSeq) };
      try {
        for await (const event of this.fresh(readStream(this.stub.WatchRun(request, this.metadata())), cursor)) {
          attempt = 0;
          yield event;
        }
        if (cursor.finished) return;
      } catch (error) {
        if (!RESUMABLE.has(error.code) || attempt >= this.maxAttempts) throw error;
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

module.exports = { connect, StargrpcClient };
