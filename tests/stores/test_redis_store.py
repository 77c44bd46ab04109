"""The Redis run store with two replicas in one process: runs watched, replayed and cancelled
from the other replica, idempotency across replicas, retention, and keys per principal."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from redis.asyncio import Redis

from stargrpc.stores.redis import RedisRunStore, RemoteRunLog
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import eventually, status_details
from tests.run_tools.blob import blob_bytes
from tests.runs_support import as_principal, collect, execute_request, key, stripped
from tests.stores.conftest import REDIS_URL

ALICE = as_principal("alice")
BOB = as_principal("bob")


@pytest.fixture
async def pair(replicas):
    """Stubs of two replicas, A and B."""
    servers = [await replicas(), await replicas()]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    yield [tool_service_pb2_grpc.ToolServiceStub(c) for c in channels]
    for channel in channels:
        await channel.close()


def runs_in(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def test_a_run_on_a_is_watched_live_and_after_the_fact_on_b(pair, tmp_path: Path) -> None:
    a, b = pair
    gate = tmp_path / "gate"
    call = a.Execute(execute_request("tally", {"path": str(tmp_path / "t"), "deltas": 3,
                                               "gate": str(gate)}, idempotency_key=key()),
                     metadata=ALICE)
    head = [(await call.read()).event for _ in range(3)]
    live = b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=head[0].run_id), metadata=ALICE)
    live_head = [(await live.read()).event for _ in range(3)]
    gate.touch()
    executed = head + await collect(call)
    watched_live = live_head + await collect(live)
    after = await collect(b.WatchRun(tool_service_pb2.WatchRunRequest(
        run_id=head[0].run_id, after_seq=2), metadata=ALICE))

    assert stripped(watched_live) == stripped(executed)
    assert stripped(after) == stripped(executed[2:])
    assert executed[-1].result.outcome == events_pb2.OUTCOME_OK


async def test_an_idempotent_retry_on_b_replays_the_run_of_a(pair, tmp_path: Path) -> None:
    a, b = pair
    tally = tmp_path / "t"
    request = execute_request("tally", {"path": str(tally)}, idempotency_key=key())

    on_a = await collect(a.Execute(request, metadata=ALICE))
    on_b = await collect(b.Execute(request, metadata=ALICE))
    bob_on_b = await collect(b.Execute(request, metadata=BOB))

    assert stripped(on_b) == stripped(on_a)
    assert bob_on_b[0].run_id != on_a[0].run_id
    assert len(runs_in(tally)) == 2  # alice once, bob once


async def test_fifty_simultaneous_executes_across_replicas_run_once(pair, tmp_path: Path
                                                                   ) -> None:
    tally = tmp_path / "t"
    request = execute_request("tally", {"path": str(tally), "deltas": 10},
                              idempotency_key=key())

    streams = await asyncio.gather(*(collect(pair[i % 2].Execute(request, metadata=ALICE))
                                     for i in range(50)))

    assert len(runs_in(tally)) == 1
    assert all(stripped(s) == stripped(streams[0]) for s in streams)


async def test_cancel_on_b_stops_the_run_on_a(pair, tmp_path: Path) -> None:
    a, b = pair
    call = a.Execute(execute_request("tally", {"path": str(tmp_path / "t"),
                                               "gate": str(tmp_path / "never")},
                                     idempotency_key=key()), metadata=ALICE)
    run_id = (await call.read()).event.run_id
    with pytest.raises(grpc.aio.AioRpcError) as not_bobs:
        await b.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id), metadata=BOB)

    reply = await b.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id, reason="stop"),
                              metadata=ALICE)
    rest = await collect(call)

    assert not_bobs.value.code() == grpc.StatusCode.NOT_FOUND
    assert reply.cancelled
    assert rest[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert rest[-1].result.error.message == "stop"


async def test_the_reused_key_check_holds_across_replicas(pair) -> None:
    a, b = pair
    same = key()
    await collect(a.Execute(execute_request("echo", {"text": "a"}, idempotency_key=same),
                            metadata=ALICE))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(b.Execute(execute_request("echo", {"text": "b"}, idempotency_key=same),
                                metadata=ALICE))

    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_unknown_and_expired_runs_are_not_found(replicas) -> None:
    server = await replicas(run_retention_seconds=0.2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        run_id = (await collect(stub.Execute(execute_request("echo", {"text": "x"}),
                                             metadata=ALICE)))[0].run_id
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await collect(stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id="nope"),
                                        metadata=ALICE))
        # Redis expires the keys itself; wait for that, bounded.
        async def refused() -> grpc.aio.AioRpcError | None:
            try:
                await collect(stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=run_id),
                                            metadata=ALICE))
            except grpc.aio.AioRpcError as error:
                return error
            return None

        expired = await eventually(refused, within=5, interval=0.05,
                                   what="the finished run expired")

    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert expired.code() == grpc.StatusCode.NOT_FOUND


async def test_watching_past_the_end_of_a_finished_run_says_it_finished(pair) -> None:
    a, b = pair
    executed = await collect(a.Execute(execute_request("echo", {"text": "x"}), metadata=ALICE))
    # The run's events are in Redis once the Result is; B reads them there.
    replay = await collect(b.WatchRun(tool_service_pb2.WatchRunRequest(
        run_id=executed[0].run_id), metadata=ALICE))
    ends = []
    for after_seq in (len(executed), len(executed) + 5):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(collect(b.WatchRun(tool_service_pb2.WatchRunRequest(
                run_id=executed[0].run_id, after_seq=after_seq), metadata=ALICE)), 10)
        ends.append(caught.value)

    assert stripped(replay) == stripped(executed)
    for error in ends:
        assert error.code() == grpc.StatusCode.OUT_OF_RANGE
        info = status_details(error)[0]
        assert info.reason == "RUN_FINISHED"
        assert dict(info.metadata) == {"run_id": executed[0].run_id,
                                       "last_seq": str(len(executed)),
                                       "outcome": "OUTCOME_OK"}


async def test_a_large_file_of_a_run_on_a_arrives_intact_through_b(pair) -> None:
    a, b = pair
    size = 5 * 1024 * 1024 + 123  # several chunks and more than one flush batch
    executed = await collect(a.Execute(execute_request("blob", {"size": size, "seed": 3}),
                                       metadata=ALICE))
    watched = await collect(b.WatchRun(tool_service_pb2.WatchRunRequest(
        run_id=executed[0].run_id), metadata=ALICE))

    data = b"".join(e.file_chunk.data for e in watched if e.HasField("file_chunk"))
    sent = watched[-1].result.writeback.sent_files[0]
    assert stripped(watched) == stripped(executed)
    assert data == blob_bytes(size, 3)
    assert sent.streamed and sent.size == size


async def test_a_watcher_on_b_that_asks_for_coalescing_gets_the_deltas_of_a_merged(
        pair, tmp_path: Path) -> None:
    # Every event of the finished run waits in Redis, so B reads them in batches and merges
    # the DELTAs of one step, as the replica running the run would for a watcher behind it.
    a, b = pair
    executed = await collect(a.Execute(execute_request(
        "tally", {"path": str(tmp_path / "t"), "deltas": 40}), metadata=ALICE))
    watched = await collect(b.WatchRun(tool_service_pb2.WatchRunRequest(
        run_id=executed[0].run_id, coalesce_deltas=True), metadata=ALICE))

    def is_delta(event: events_pb2.RunEvent) -> bool:
        return event.HasField("step") and event.step.phase == events_pb2.STEP_PHASE_DELTA

    def texts(events: list[events_pb2.RunEvent]) -> str:
        return "".join(e.step.delta for e in events if is_delta(e))

    merged = [e for e in watched if is_delta(e) and e.first_seq]
    assert merged and len(watched) < len(executed)
    assert texts(watched) == texts(executed)
    assert [e.seq for e in watched if not is_delta(e)] == \
        [e.seq for e in executed if not is_delta(e)]
    assert watched[-1].result == executed[-1].result


async def test_every_key_a_run_leaves_in_redis_expires(pair, redis_prefix: str) -> None:
    a, b = pair
    request = execute_request("echo", {"text": "x"}, idempotency_key=key())
    await collect(a.Execute(request, metadata=ALICE))
    await collect(b.Execute(request, metadata=ALICE))
    await collect(b.Execute(execute_request("count", {"to": 2}), metadata=BOB))

    redis = Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in redis.scan_iter(match=f"{redis_prefix}*")]
        ttls = {k: await redis.pttl(k) for k in keys}
    finally:
        await redis.aclose()
    assert len(keys) >= 5  # two runs (hash + stream each) and one claim, at least
    assert all(ttl > 0 for ttl in ttls.values()), ttls


async def test_a_watcher_on_b_of_a_run_just_admitted_on_a_waits_for_its_first_write(
        make_server, stallable_redis) -> None:
    """The race a fleet meets when a client passes a run id on at once: the run (without an
    idempotency key) has started on A, its caller has every event already (A streams from
    memory), and Redis has none of it yet — its first write held up (here: writes paused
    with CLIENT PAUSE WRITE on a Redis of the test's own). WatchRun on B waits for the
    run's first write instead of answering NOT_FOUND; an id of the same age that no replica
    admitted is NOT_FOUND all the same once the wait is over."""
    from tests.runs_support import HeaderPrincipal, run_registry

    servers = [await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                                 redis_url=stallable_redis.url, redis_key_prefix="race:",
                                 redis_timeout_seconds=1.0) for _ in range(2)]
    admin = Redis.from_url(stallable_redis.url)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    try:
        a, b = (tool_service_pb2_grpc.ToolServiceStub(c) for c in channels)
        await collect(a.Execute(execute_request("echo", {"text": "warm"}), metadata=ALICE))
        await admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
        executed = await collect(a.Execute(execute_request("count", {"to": 5}),
                                           metadata=ALICE))
        watch = b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=executed[0].run_id),
                           metadata=ALICE)
        watching = asyncio.ensure_future(collect(watch))
        async def waiting_on_the_stream() -> bool:  # or answered already
            clients = (await admin.execute_command("CLIENT", "LIST")).decode()
            return watching.done() or any("cmd=xread" in line and "flags=b" in line
                                          for line in clients.splitlines())

        # Redis's client list has no event to await.
        await eventually(waiting_on_the_stream, within=4, what="B waiting on the run's stream")
        assert not watching.done(), watching.result()
        assert not (await admin.get("race:run:" + executed[0].run_id))  # nothing written
        await admin.execute_command("CLIENT", "UNPAUSE")
        watched = await asyncio.wait_for(watching, 30)

        unknown = executed[0].run_id[:20] + "0" * 12  # as young, but admitted nowhere
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=unknown),
                                     metadata=ALICE))
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
        for channel in channels:
            await channel.close()
    assert executed[-1].result.outcome == events_pb2.OUTCOME_OK
    assert stripped(watched) == stripped(executed)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_remote_log_without_the_bytes_of_an_event_raises_index_error(
        redis_prefix: str) -> None:
    # As RunLog.encoded says (and the in-memory log does): IndexError, not a KeyError.
    store = RedisRunStore(Redis.from_url(REDIS_URL), prefix=redis_prefix)
    try:
        remote = RemoteRunLog(store.leases, "run", "alice", "echo", finished=False, last_seq=0)
        with pytest.raises(IndexError):
            remote.encoded(1)
    finally:
        await store.aclose()


async def test_a_run_id_naming_a_key_of_a_run_is_not_found_like_an_unknown_one(
        pair, tmp_path: Path) -> None:
    # "<run id>:events" was looked up as a run's meta hash: Redis answered WRONGTYPE, told as
    # UNAVAILABLE (RUN_STORE_FAILED) for a run that exists and NOT_FOUND for one that does
    # not — an answer that told another principal which of its guesses exist.
    a, b = pair
    gate = tmp_path / "gate"
    call = a.Execute(execute_request("tally", {"path": str(tmp_path / "t"),
                                               "gate": str(gate)}), metadata=ALICE)
    run_id = (await call.read()).event.run_id
    await eventually(lambda: _visible_on(b, run_id), within=10, interval=0.02,
                     what="the run in Redis")
    codes = []
    for name in (f"{run_id}:events", f"{run_id}:lease", f"{run_id}:cancel",
                 "nosuchrun:events"):
        for method, request in (
                (b.CancelRun, tool_service_pb2.CancelRunRequest(run_id=name)),
                (b.SteerRun, tool_service_pb2.SteerRunRequest(run_id=name, message="hi")),
                (b.ApproveRun, tool_service_pb2.ApproveRunRequest(
                    run_id=name, approval_id="x", decision=1))):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await method(request, metadata=as_principal("bob", "approver"))
            codes.append((name, refused.value.code()))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=name),
                                     metadata=BOB))
        codes.append((name, refused.value.code()))
    gate.touch()
    executed = await collect(call)

    assert {code for _, code in codes} == {grpc.StatusCode.NOT_FOUND}, codes
    assert executed[-1].result.outcome == events_pb2.OUTCOME_OK


async def _visible_on(stub, run_id: str) -> bool:
    summaries = await stub.ListRuns(tool_service_pb2.ListRunsRequest(), metadata=ALICE)
    return any(run.run_id == run_id for run in summaries.runs)
