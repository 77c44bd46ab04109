"""The Python runner of the conformance suite (``conformance/cases.json``): runs every case
with :class:`stargrpc.client.AsyncClient` against one live server started with
``--tools-dir conformance/tools``, prints ``PASS name`` or ``FAIL name: why`` per case, then
``N passed, M failed``, and exits 1 when a case failed::

    python -m stargrpc.client.conformance --target 127.0.0.1:50051 --api-key "$STARGRPC_API_KEY"

Where the SDK has no option for what a case sends (``coalesce_deltas``; a raw WatchRun to
read the RUN_FINISHED status; a stale catalog hash, which the SDK would reload), the case
uses the generated stub on a channel with the same credentials, and decodes refusals with
:meth:`CallError.from_rpc_error`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from stargrpc.client.aio import AsyncClient
from stargrpc.client.channel import bearer_metadata, open_channel
from stargrpc.client.errors import CallError
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc

CASES = Path(__file__).resolve().parents[2] / "conformance" / "cases.json"
CASE_TIMEOUT = 60.0

Case = dict[str, Any]
Events = list[events_pb2.RunEvent]


class Failed(Exception):
    """A case's condition does not hold."""


def check(condition: object, why: str) -> None:
    """Fails the case with ``why`` unless ``condition`` holds."""
    if not condition:
        raise Failed(why)


def _arguments(case: Case) -> str:
    return str(case.get("arguments_json") or json.dumps(case.get("arguments", {})))


def _check_gapless(events: Events) -> None:
    seqs = [e.seq for e in events]
    check(seqs == list(range(1, len(seqs) + 1)), f"seqs are not 1..n: {seqs[:20]}")
    check(len({e.run_id for e in events}) == 1, "events of more than one run")


def _check_ends_with_result(events: Events, outcome: int, output: str | None = None) -> None:
    results = [i for i, e in enumerate(events) if e.WhichOneof("kind") == "result"]
    check(results == [len(events) - 1], f"Results at {results} of {len(events)} events")
    result = events[-1].result
    check(result.outcome == outcome, f"outcome {events_pb2.Outcome.Name(result.outcome)} "
          f"({result.error.code} {result.error.message})")
    if output is not None:
        check(result.output == output, f"output {result.output!r}")


def _check_refused(error: CallError | None, code: grpc.StatusCode, reason: str) -> CallError:
    check(error is not None, "the call was not refused")
    assert error is not None
    check(error.code == code and error.reason == reason,
          f"refused {error.code.name} [{error.reason}], not {code.name} [{reason}]")
    return error


class _Proxy:
    """A TCP proxy whose :meth:`cut` closes every connection through it (it keeps
    accepting new ones)."""

    def __init__(self, target: str) -> None:
        self._host, port = target.rsplit(":", 1)
        self._port = int(port)
        self._writers: list[asyncio.StreamWriter] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


class Runner:
    """Runs the cases against one server."""

    def __init__(self, target: str, api_key: str) -> None:
        self.target = target
        self.api_key = api_key or None
        self.client = AsyncClient.connect(target, api_key=self.api_key)
        self.channel = open_channel(target)
        self.stub = tool_service_pb2_grpc.ToolServiceStub(self.channel)
        self.metadata = bearer_metadata(self.api_key)

    async def close(self) -> None:
        await self.client.close()
        await self.channel.close()

    async def events(self, case: Case, client: AsyncClient | None = None,
                     **options: Any) -> Events:
        """Every event of one Execute through the SDK (``.raw`` protos)."""
        return [event.raw async for event in (client or self.client).execute(
            case["tool"], _arguments(case), **options)]

    async def refusal(self, case: Case, **options: Any) -> CallError | None:
        try:
            await self.events(case, **options)
        except CallError as error:
            return error
        return None

    async def raw(self, call: Any) -> Events:
        """Every event of a raw stream; a refusal raises CallError."""
        try:
            return [response.event async for response in call]
        except grpc.aio.AioRpcError as error:
            raise CallError.from_rpc_error(error) from error

    # -- the cases ---------------------------------------------------------------------

    async def seq_gapless_from_1(self, case: Case) -> None:
        _check_gapless(await self.events(case))

    async def steps_start_delta_end_nested(self, case: Case) -> None:
        events = await self.events(case)
        started: dict[str, str] = {}
        ended: set[str] = set()
        deltas: dict[str, list[str]] = {}
        for event in (e for e in events if e.WhichOneof("kind") == "step"):
            step, phase = event.step.step, event.step.phase
            if phase == events_pb2.STEP_PHASE_START:
                check(step.id not in started, f"step {step.id} started twice")
                check(step.parent_id == "" if not started else
                      step.parent_id in started and step.parent_id not in ended,
                      f"step {step.id} starts outside a running parent {step.parent_id!r}")
                started[step.id] = step.parent_id
            elif phase == events_pb2.STEP_PHASE_DELTA:
                check(step.id in started and step.id not in ended, f"delta outside step {step.id}")
                deltas.setdefault(step.id, []).append(event.step.delta)
            else:
                check(step.id in started and step.id not in ended, f"step {step.id} ends twice")
                check(not [c for c, p in started.items() if p == step.id and c not in ended],
                      f"step {step.id} ends before its children")
                check(step.status == events_pb2.STEP_STATUS_COMPLETE, f"step {step.id} status")
                ended.add(step.id)
        check(set(started) == ended, "a step never ended")
        check([s for s, p in started.items() if not p] == [next(iter(started))],
              "not exactly one top-level step, started first")
        depth = {s: 0 for s in started}
        for step_id, parent in started.items():
            depth[step_id] = depth[parent] + 1 if parent else 0
        inner = [s for s, d in depth.items() if d == 2]
        check(inner, "no step nested two levels deep")
        check(deltas.get(inner[0]) == ["1\n", "2\n", "3\n"], f"inner deltas {deltas}")

    async def one_result_last(self, case: Case) -> None:
        _check_ends_with_result(await self.events(case), events_pb2.OUTCOME_OK, "steps 3")

    async def bad_arguments_bad_request(self, case: Case) -> None:
        error = _check_refused(await self.refusal(case), grpc.StatusCode.INVALID_ARGUMENT,
                               "INVALID_ARGUMENT")
        check("arguments.items" in [v.field for v in error.violations],
              f"violations {error.violations}")

    async def unknown_tool_not_found(self, case: Case) -> None:
        _check_refused(await self.refusal(case), grpc.StatusCode.NOT_FOUND, "TOOL_NOT_FOUND")

    async def stale_catalog_refused(self, case: Case) -> None:
        # The SDK reloads a stale catalog and retries; the raw refusal is what is checked.
        request = tool_service_pb2.ExecuteRequest(
            tool_name=case["tool"], arguments_json=_arguments(case),
            catalog_hash=case["catalog_hash"], idempotency_key=uuid.uuid4().hex)
        try:
            await self.raw(self.stub.Execute(request, metadata=self.metadata))
        except CallError as error:
            _check_refused(error, grpc.StatusCode.FAILED_PRECONDITION, "CATALOG_STALE")
            return
        raise Failed("the call was not refused")

    async def cancel_then_watch_shows_cancelled(self, case: Case) -> None:
        stream = self.client.execute(case["tool"], _arguments(case))
        first = await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]  # an async generator
        # The stream is closed; the run, which has an idempotency key, goes on until:
        await self.client.cancel(first.run_id, "conformance: cancelled by the caller")
        watched = [e.raw async for e in self.client.watch(first.run_id)]
        _check_gapless(watched)
        _check_ends_with_result(watched, events_pb2.OUTCOME_CANCELLED)

    async def resume_after_cut(self, case: Case) -> None:
        proxy = _Proxy(self.target)
        target = await proxy.start()
        try:
            async with AsyncClient.connect(target, api_key=self.api_key) as client:
                events: Events = []
                async for event in client.execute(case["tool"], _arguments(case)):
                    events.append(event.raw)
                    if len(events) == case["cut_after_events"]:
                        proxy.cut()
        finally:
            await proxy.close()
        _check_gapless(events)
        _check_ends_with_result(events, events_pb2.OUTCOME_OK, "steps 6")
        check(proxy.connections > 1, "the client did not connect again after the cut")

    async def run_finished_past_the_end(self, case: Case) -> None:
        events = await self.events(case)
        last = events[-1]
        try:
            await self.raw(self.stub.WatchRun(tool_service_pb2.WatchRunRequest(
                run_id=last.run_id, after_seq=last.seq), metadata=self.metadata))
            raise Failed("WatchRun past the end ended OK")
        except CallError as error:
            _check_refused(error, grpc.StatusCode.OUT_OF_RANGE, "RUN_FINISHED")
            check(error.metadata.get("last_seq") == str(last.seq)
                  and error.metadata.get("outcome") == "OUTCOME_OK",
                  f"metadata {error.metadata}")
        watched = [e async for e in self.client.watch(last.run_id, last.seq)]
        check(watched == [], f"watch past the end delivered {len(watched)} events")

    async def idempotent_attach_replay_reuse(self, case: Case) -> None:
        key = uuid.uuid4().hex
        first_stream = self.client.execute(case["tool"], _arguments(case), idempotency_key=key)
        first = [(await anext(first_stream)).raw]
        attached = await self.events(case, idempotency_key=key)
        first += [e.raw async for e in first_stream]
        replayed = await self.events(case, idempotency_key=key)

        def shape(events: Events) -> list[tuple[str, int, str | None]]:
            return [(e.run_id, e.seq, e.WhichOneof("kind")) for e in events]

        _check_ends_with_result(first, events_pb2.OUTCOME_OK)
        check(shape(attached) == shape(first), "the attached call saw other events")
        check(shape(replayed) == shape(first) and replayed[-1].result == first[-1].result,
              "the replay differs from the run")
        reuse = {**case, "arguments": case["reuse_arguments"]}
        _check_refused(await self.refusal(reuse, idempotency_key=key),
                       grpc.StatusCode.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED")

    async def client_deadline_timeout(self, case: Case) -> None:
        events: Events = []
        try:
            async for event in self.client.execute(case["tool"], _arguments(case),
                                                   timeout=case["deadline_seconds"]):
                events.append(event.raw)
        except CallError as error:
            check(error.code == grpc.StatusCode.DEADLINE_EXCEEDED, f"ended with {error}")
        check(events, "no event before the deadline")
        if events[-1].WhichOneof("kind") != "result":
            events = [e.raw async for e in self.client.watch(events[0].run_id)]
        _check_ends_with_result(events, events_pb2.OUTCOME_TIMEOUT)
        check(events[-1].result.error.code == "CLIENT_DEADLINE",
              f"code {events[-1].result.error.code}")

    async def chunked_file_sha256(self, case: Case) -> None:
        events = await self.events(case)
        chunks = [e.file_chunk for e in events if e.WhichOneof("kind") == "file_chunk"]
        _check_ends_with_result(events, events_pb2.OUTCOME_OK)
        check(len(chunks) > 1, f"{len(chunks)} chunks")
        offset = 0
        for chunk in chunks:
            check(chunk.offset == offset, f"chunk at {chunk.offset}, expected {offset}")
            offset += len(chunk.data)
        check([c.last for c in chunks] == [False] * (len(chunks) - 1) + [True], "last flags")
        data = b"".join(c.data for c in chunks)
        digest = hashlib.sha256(data).hexdigest()
        sent = events[-1].result.writeback.sent_files
        size = case["arguments"]["size"]
        check(len(sent) == 1 and sent[0].streamed and sent[0].size == size == len(data),
              f"sent files {[(f.name, f.size, f.streamed) for f in sent]}, {len(data)} bytes")
        check(sent[0].sha256 == digest == events[-1].result.output, "sha256 differs")

    async def coalesced_deltas_gapless(self, case: Case) -> None:
        # The SDK has no coalesce_deltas option: the stub, read slowly at first.
        request = tool_service_pb2.ExecuteRequest(
            tool_name=case["tool"], arguments_json=_arguments(case), coalesce_deltas=True,
            idempotency_key=uuid.uuid4().hex)
        events: Events = []

        async def read() -> AsyncIterator[events_pb2.RunEvent]:
            async for response in self.stub.Execute(request, metadata=self.metadata):
                yield response.event

        async for event in read():
            events.append(event)
            if len(events) == 1:
                await asyncio.sleep(case["pause_seconds"])
        _check_coalesced(events, case["arguments"]["count"])

    async def big_integer_arguments_json(self, case: Case) -> None:
        _check_ends_with_result(await self.events(case), events_pb2.OUTCOME_OK, case["output"])


def _check_coalesced(events: Events, count: int) -> None:
    last = 0
    for event in events:
        first = event.first_seq or event.seq
        check(first == last + 1 and event.seq >= first,
              f"message {first}..{event.seq} after seq {last}")
        last = event.seq
    text = "".join(e.step.delta for e in events if e.WhichOneof("kind") == "step"
                   and e.step.phase == events_pb2.STEP_PHASE_DELTA)
    check(text == "".join(f"{i}\n" for i in range(1, count + 1)), "the delta texts differ")
    check(any(e.first_seq for e in events), "no message was coalesced")
    _check_ends_with_result(events, events_pb2.OUTCOME_OK, f"burst {count}")


async def run_cases(target: str, api_key: str, cases: list[Case]) -> int:
    """Runs ``cases``, printing one line each and the totals; the number that failed."""
    runner = Runner(target, api_key)
    failed = 0
    try:
        for case in cases:
            method: Callable[[Case], Awaitable[None]] | None = getattr(runner, case["name"], None)
            try:
                if method is None:
                    raise Failed("not implemented by this runner")
                await asyncio.wait_for(method(case), CASE_TIMEOUT)
                print(f"PASS {case['name']}", flush=True)
            except Exception as error:  # any failure is the case's verdict
                failed += 1
                why = str(error) or type(error).__name__
                print(f"FAIL {case['name']}: {' '.join(why.split())}", flush=True)
    finally:
        await runner.close()
    print(f"{len(cases) - failed} passed, {failed} failed", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 1 when a case failed."""
    parser = argparse.ArgumentParser(prog="python -m stargrpc.client.conformance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.environ.get("STARGRPC_TARGET", "localhost:50051"))
    parser.add_argument("--api-key", default=os.environ.get("STARGRPC_API_KEY", ""))
    parser.add_argument("--cases", type=Path, default=CASES)
    args = parser.parse_args(argv)
    cases = json.loads(args.cases.read_text())["cases"]
    return 1 if asyncio.run(run_cases(args.target, args.api_key, cases)) else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Runner", "main", "run_cases"]
