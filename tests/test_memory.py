"""Memory given back: a finished run is freed the moment its retention ends, without waiting
for the cyclic garbage collector (the tuned collector of a serving process rarely makes a
full collection), and finished runs are bounded by bytes as well as by count."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import grpc
import pytest

from stargrpc import SyncToolContext, ToolContext, tool
from stargrpc.registry import Registry, spec_of
from stargrpc.runs.run import Run
from stargrpc.runs.runtime import RunInput, RunInterceptor
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.stores.memory import MemoryRunStore
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.runs_support import collect, execute_request, key, run_registry


@pytest.fixture
def no_cycle_collection() -> Iterator[None]:
    """Runs the test with the cyclic collector off: what it frees, reference counting
    alone freed."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _track(server: StargrpcServer) -> list[weakref.ref[object]]:
    """Weak references to each run the server launches from now on, and to its log."""
    refs: list[weakref.ref[object]] = []

    class Remember(RunInterceptor):
        def start(self, input: RunInput) -> Run:
            refs.extend((weakref.ref(input.run), weakref.ref(input.run.log)))
            return self.next.start(input)

    server.runtime.add_interceptor(Remember())
    return refs


def _alive(refs: list[weakref.ref[object]]) -> list[str]:
    return [type(obj).__name__ for ref in refs if (obj := ref()) is not None]


async def _expire(server: StargrpcServer) -> None:
    store = server.runtime.store
    assert isinstance(store, MemoryRunStore)
    store.retention = 0
    store.get("")  # expiry runs on the store's next use


@tool()
async def crashes(ctx: ToolContext) -> str:
    """Raises inside a step: the traceback's frames hold the context and the step."""
    async with ctx.step("about to fail"):
        raise RuntimeError("boom")


@tool()
def blocks(ctx: SyncToolContext) -> str:
    """A plain ``def`` tool (runs in a thread) that streams a delta."""
    ctx.delta("from a thread")
    return "done"


@tool()
async def waits(ctx: ToolContext) -> str:
    """Streams a delta, then waits until cancelled."""
    await ctx.delta("waiting")
    await asyncio.Event().wait()
    return "never"


def _registry() -> Registry:
    specs = [spec_of(fn) for fn in (crashes, blocks, waits)]
    return Registry([*run_registry().values(), *(spec for spec in specs if spec)])


@pytest.mark.parametrize("tracing", [False, True])
async def test_expired_runs_are_freed_without_the_cycle_collector(
        make_server, no_cycle_collection, tracing) -> None:
    server = await make_server(registry=_registry(), tracing=tracing)
    refs = _track(server)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        for _ in range(3):
            events = await collect(stub.Execute(execute_request("count", {"to": 50})))
            assert events[-1].result.outcome == events_pb2.OUTCOME_OK
            await collect(stub.WatchRun(tool_service_pb2.WatchRunRequest(
                run_id=events[0].run_id)))
        # Every other way a run can go: keyed, raising, in a thread, cancelled by the
        # client going away, cancelled with CancelRun.
        await collect(stub.Execute(execute_request("count", {"to": 3},
                                                   idempotency_key=key())))
        crashed = await collect(stub.Execute(execute_request("crashes")))
        assert crashed[-1].result.error.code == "TOOL_EXCEPTION"
        threaded = await collect(stub.Execute(execute_request("blocks")))
        assert threaded[-1].result.output == "done"
        call = stub.Execute(execute_request("waits"))
        await call.read()  # the run has started
        call.cancel()
        call = stub.Execute(execute_request("waits", idempotency_key=key()))
        run_id = (await call.read()).event.run_id
        await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id))
        stopped = await collect(call)
        assert stopped[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
        await server.runtime.drain(5)  # every run has ended
        await _expire(server)

    assert len(refs) == 2 * 8
    assert _alive(refs) == []


async def test_finished_runs_over_the_byte_bound_expire_oldest_first(make_server) -> None:
    # Each run streams 20 deltas of 10,000 characters: about 200 KB of events.
    server = await make_server(registry=run_registry(), max_finished_run_bytes=500_000)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        run_ids = []
        for _ in range(5):
            events = await collect(stub.Execute(execute_request(
                "chatter", {"count": 20, "size": 10_000})))
            run_ids.append(events[0].run_id)

        watchable = []
        for run_id in run_ids:
            try:
                replay = await collect(stub.WatchRun(
                    tool_service_pb2.WatchRunRequest(run_id=run_id)))
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.NOT_FOUND
            else:
                assert replay[-1].HasField("result")
                watchable.append(run_id)

    assert watchable == run_ids[-2:]
