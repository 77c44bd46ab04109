"""The bare baseline: grpc.aio with one server-streaming method and no framework at all.

It serves ``stargrpc.v1.ToolService/Execute`` so that the very same client code drives it and
stargrpc, and answers the benchmark tools' names (``bench/tools``) with the same messages
stargrpc sends — real ``stargrpc.v1`` RunEvents, built per message with the same fields and
sizes (START, the deltas, END, Result) — but with nothing in between: no interceptors, no
argument validation, no run, no event log. It is the limit a Python gRPC service reaches
on this machine.

Run: ``python -m bench.baseline_server --port 0``; it prints one JSON line
``{"event": "serving", "address": "127.0.0.1:PORT"}`` once it accepts calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from stargrpc.v1 import events_pb2, tool_service_pb2

_SERVICE = "stargrpc.v1.ToolService"


class _Events:
    """Builds one run's events the way stargrpc shapes them, one fresh message each."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name
        self.run_id = uuid.uuid4().hex
        self.seq = 0
        self.started = time.monotonic()
        self.started_at: Any = None

    def _event(self) -> tool_service_pb2.ExecuteResponse:
        self.seq += 1
        response = tool_service_pb2.ExecuteResponse()
        event = response.event
        event.run_id = self.run_id
        event.seq = self.seq
        event.time.GetCurrentTime()
        # stargrpc's events carry the critic's countdown: the same field, the same size.
        event.critic_time_left.seconds = 89
        event.critic_time_left.nanos = 999_000_000
        return response

    def _root(self, step: events_pb2.Step, status: int) -> None:
        step.id = "s0"
        step.kind = "bench"
        step.title = self.tool_name
        step.status = status  # type: ignore[assignment]

    def start(self) -> tool_service_pb2.ExecuteResponse:
        response = self._event()
        message = response.event.step
        message.phase = events_pb2.STEP_PHASE_START
        self._root(message.step, events_pb2.STEP_STATUS_RUNNING)
        message.step.started_at.CopyFrom(response.event.time)
        self.started_at = response.event.time
        return response

    def delta(self, text: str) -> tool_service_pb2.ExecuteResponse:
        response = self._event()
        message = response.event.step
        message.phase = events_pb2.STEP_PHASE_DELTA
        message.step.id = "s0"
        message.delta = text
        return response

    def end(self) -> tool_service_pb2.ExecuteResponse:
        response = self._event()
        message = response.event.step
        message.phase = events_pb2.STEP_PHASE_END
        self._root(message.step, events_pb2.STEP_STATUS_COMPLETE)
        message.step.started_at.CopyFrom(self.started_at)
        message.step.ended_at.CopyFrom(response.event.time)
        return response

    def result(self, output: str) -> tool_service_pb2.ExecuteResponse:
        response = self._event()
        result = response.event.result
        result.outcome = events_pb2.OUTCOME_OK
        result.output = output
        result.duration.FromNanoseconds(int((time.monotonic() - self.started) * 1e9))
        return response


async def execute(request: tool_service_pb2.ExecuteRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """The bare streaming method: the benchmark tools' messages, nothing else."""
    arguments = json.loads(request.arguments_json or "{}")
    events = _Events(request.tool_name)
    yield events.start()
    output = ""
    if request.tool_name == "bench_stream":
        n = int(arguments.get("n", 20_000))
        # coalesce > 1 packs that many deltas into one message: what a server coalescing
        # deltas under backpressure could reach, measured on the bare transport.
        per_message = max(1, int(arguments.get("coalesce", 1)))
        for first in range(1, n + 1, per_message):
            last = min(n, first + per_message - 1)
            yield events.delta("".join(f"{i:07d}\n" for i in range(first, last + 1)))
        output = f"streamed {n}"
    elif request.tool_name == "bench_wait":
        await asyncio.sleep(float(arguments.get("ms", 10.0)) / 1000)
    elif request.tool_name == "bench_hold":
        await asyncio.sleep(float(arguments.get("seconds", 30.0)))
    elif request.tool_name != "bench_trivial":
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tool {request.tool_name!r}")
    yield events.end()
    yield events.result(output)


async def serve(host: str, port: int) -> None:
    """Serves until SIGTERM or SIGINT."""
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(_SERVICE, {
        "Execute": grpc.unary_stream_rpc_method_handler(
            execute,
            request_deserializer=tool_service_pb2.ExecuteRequest.FromString,
            response_serializer=tool_service_pb2.ExecuteResponse.SerializeToString,
        ),
    })
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(json.dumps({"event": "serving", "address": f"{host}:{bound}"}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline_server",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port))
    sys.exit(0)


if __name__ == "__main__":
    main()
