"""WatchRun and CancelRun through a real server: replay and follow, resume without gaps or
duplicates, ownership, retention, slow watchers, and what dropping an Execute stream does."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from stargrpc.principal import Principal, current_principal
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import phases, status_details
from tests.runs_support import (
    HeaderPrincipal,
    as_principal,
    collect,
    execute_request,
    key,
    run_registry,
    stripped,
)

ALICE = as_principal("alice")
BOB = as_principal("bob")
ADMIN = as_principal("root", "admin")
WATCHER = as_principal("ui", "watch")


@pytest.fixture
async def stub(make_server) -> tool_service_pb2_grpc.ToolServiceStub:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield tool_service_pb2_grpc.ToolServiceStub(channel)
    await channel.close()


def watch(stub, run_id: str, after_seq: int = 0, metadata=ALICE):
    return stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=run_id, after_seq=after_seq),
                         metadata=metadata)


async def test_watch_replays_a_finished_run_exactly(stub) -> None:
    executed = await collect(stub.Execute(execute_request("count", {"to": 3}), metadata=ALICE))
    run_id = executed[0].run_id

    watched = await collect(watch(stub, run_id))
    tail = await collect(watch(stub, run_id, after_seq=5))

    assert stripped(watched) == stripped(executed)
    assert [e.seq for e in tail] == list(range(6, len(executed) + 1))
    assert phases(tail)[-1] == "RESULT OK"


async def test_watch_follows_a_live_run_then_resumes_without_gaps(stub, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    call = stub.Execute(execute_request(
        "tally", {"path": str(tmp_path / "tally"), "deltas": 2, "gate": str(gate)},
        idempotency_key=key()), metadata=ALICE)
    seen = [(await call.read()).event for _ in range(3)]
    call.cancel()  # the client loses its stream; the run has a key, so it goes on
    live = watch(stub, seen[0].run_id, after_seq=seen[-1].seq)
    first_live = (await live.read()).event
    gate.touch()
    rest = [first_live, *(await collect(live))]

    assert [e.seq for e in [*seen, *rest]] == list(range(1, len(seen) + len(rest) + 1))
    assert rest[-1].result.outcome == events_pb2.OUTCOME_OK
    assert rest[-1].result.output == "tallied 2"


async def test_dropping_the_stream_of_a_run_without_key_cancels_it(stub, tmp_path: Path
                                                                    ) -> None:
    call = stub.Execute(execute_request(
        "tally", {"path": str(tmp_path / "tally"), "deltas": 0,
                  "gate": str(tmp_path / "never")}), metadata=ALICE)
    first = (await call.read()).event
    call.cancel()

    events = await collect(watch(stub, first.run_id))

    assert events[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert events[-1].result.error.code == "CLIENT_CANCELLED"


async def test_unknown_run_is_not_found(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(watch(stub, "no-such-run"))

    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert status_details(caught.value)[0].reason == "RUN_NOT_FOUND"


async def test_other_principals_get_not_found_but_admin_and_watch_roles_see_it(stub) -> None:
    executed = await collect(stub.Execute(execute_request("echo", {"text": "hi"}),
                                          metadata=ALICE))
    run_id = executed[0].run_id

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(watch(stub, run_id, metadata=BOB))
    with pytest.raises(grpc.aio.AioRpcError) as cancel_caught:
        await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id), metadata=BOB)
    with pytest.raises(grpc.aio.AioRpcError) as watcher_cancel:
        await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id),
                             metadata=WATCHER)

    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert cancel_caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert watcher_cancel.value.code() == grpc.StatusCode.NOT_FOUND  # watching is not cancelling
    assert stripped(await collect(watch(stub, run_id, metadata=ADMIN))) == stripped(executed)
    assert stripped(await collect(watch(stub, run_id, metadata=WATCHER))) == stripped(executed)


async def test_cancel_run_ends_it_cancelled_with_the_reason_for_every_watcher(
        stub, tmp_path: Path) -> None:
    call = stub.Execute(execute_request(
        "tally", {"path": str(tmp_path / "tally"), "deltas": 1,
                  "gate": str(tmp_path / "never")}, idempotency_key=key()), metadata=ALICE)
    run_id = (await call.read()).event.run_id
    watchers = [asyncio.ensure_future(collect(watch(stub, run_id, metadata=m)))
                for m in (ALICE, ADMIN)]

    reply = await stub.CancelRun(tool_service_pb2.CancelRunRequest(
        run_id=run_id, reason="user pressed stop"), metadata=ALICE)
    rest = await collect(call)
    again = await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id),
                                 metadata=ADMIN)

    assert reply.cancelled is True
    assert again.cancelled is False
    for events in [rest, *await asyncio.gather(*watchers)]:
        assert events[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
        assert events[-1].result.error.message == "user pressed stop"


async def test_finished_runs_expire_after_retention(make_server) -> None:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                               run_retention_seconds=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        executed = await collect(stub.Execute(execute_request("echo", {"text": "x"}),
                                              metadata=ALICE))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(watch(stub, executed[0].run_id))

    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_slow_watcher_is_ended_with_where_to_resume_and_never_slows_the_run(
        make_server, tmp_path: Path) -> None:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                               max_watch_lag_events=50)
    gate, hold = tmp_path / "gate", tmp_path / "hold"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        call = stub.Execute(execute_request(
            "chatter", {"count": 2000, "size": 2000, "gate": str(gate), "hold": str(hold)},
            idempotency_key=key()), metadata=ALICE)
        run_id = (await call.read()).event.run_id
        call.cancel()
        slow = watch(stub, run_id)
        got = [(await slow.read()).event]  # caught up with the live run: now stop reading
        gate.touch()
        run = server.runtime.runs.get(run_id)
        assert run is not None
        # The run sends everything while the watcher reads nothing: it is not slowed down.
        async with contextlib.aclosing(run.log.follow()) as events:
            async for event in events:
                if event.HasField("heartbeat") and event.heartbeat.message == "sent":
                    break
        # Reading again, the watcher finds itself far behind a run still going: ended.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            while (response := await slow.read()) is not grpc.aio.EOF:
                got.append(response.event)
        hold.touch()
        result = await asyncio.wait_for(run.wait(), 60)
        resume = int(status_details(caught.value)[0].metadata["resume_after_seq"])
        rest = await collect(watch(stub, run_id, after_seq=resume))

    assert result.outcome == events_pb2.OUTCOME_OK
    assert caught.value.code() == grpc.StatusCode.ABORTED
    assert resume == got[-1].seq
    assert [e.seq for e in [*got, *rest]] == list(range(1, rest[-1].seq + 1))


def _run_finished(error: grpc.aio.AioRpcError) -> dict[str, str]:
    """The ErrorInfo metadata of a RUN_FINISHED answer (asserting that it is one)."""
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE, error
    info = status_details(error)[0]
    assert (info.reason, info.domain) == ("RUN_FINISHED", "stargrpc")
    return dict(info.metadata)


async def test_watching_at_or_past_the_end_of_a_finished_run_says_it_finished(stub) -> None:
    executed = await collect(stub.Execute(execute_request("count", {"to": 2}), metadata=ALICE))
    run_id, last = executed[0].run_id, len(executed)

    answers = []
    for after_seq in (last, last + 1, 2**64 - 1):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(watch(stub, run_id, after_seq=after_seq))
        answers.append(caught.value)
    just_before = await collect(watch(stub, run_id, after_seq=last - 1))

    for error in answers:
        assert _run_finished(error) == {"run_id": run_id, "last_seq": str(last),
                                        "outcome": "OUTCOME_OK"}
    assert f"its Result is event {last}" in (answers[0].details() or "")
    assert stripped(just_before) == stripped(executed[-1:])  # the server keeps serving


async def test_a_watcher_waiting_past_the_end_of_a_live_run_is_told_when_it_ends(
        stub, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    call = stub.Execute(execute_request(
        "tally", {"path": str(tmp_path / "tally"), "deltas": 0, "gate": str(gate)},
        idempotency_key=key()), metadata=ALICE)
    run_id = (await call.read()).event.run_id
    waiting = asyncio.ensure_future(collect(watch(stub, run_id, after_seq=1000)))
    # A few heartbeats later the watcher is following the live run, waiting for seq 1001.
    while (await call.read()).event.seq < 4:
        pass
    gate.touch()
    executed = await collect(call)

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(waiting, 30)
    assert _run_finished(caught.value)["last_seq"] == str(executed[-1].seq)
    assert _run_finished(caught.value)["outcome"] == "OUTCOME_OK"


async def test_a_cancelled_run_reports_its_outcome_past_the_end(stub, tmp_path: Path) -> None:
    call = stub.Execute(execute_request(
        "tally", {"path": str(tmp_path / "tally"), "deltas": 0,
                  "gate": str(tmp_path / "never")}, idempotency_key=key()), metadata=ALICE)
    run_id = (await call.read()).event.run_id
    await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id), metadata=ALICE)
    last = (await collect(call))[-1].seq

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(watch(stub, run_id, after_seq=last))
    with pytest.raises(grpc.aio.AioRpcError) as other:
        await collect(watch(stub, run_id, after_seq=last, metadata=BOB))

    assert _run_finished(caught.value)["outcome"] == "OUTCOME_CANCELLED"
    assert other.value.code() == grpc.StatusCode.NOT_FOUND  # nothing leaks to others


class _BareContext:
    """What Execute asks of its servicer context when no interceptor is in front of it."""

    def time_remaining(self) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: object) -> None:
        raise AssertionError(f"aborted: {code} {details}")


async def test_a_call_cancelled_at_its_first_wait_stops_its_run(make_server, tmp_path: Path
                                                                 ) -> None:
    # Execute lets a new run's task go first (one turn of the loop) before it reads the
    # run's log: a call cancelled right there, before it sent anything, still stops a run
    # without a key, as a call cancelled later does.
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()])
    current_principal.set(Principal(id="alice", roles=frozenset(), method="test"))
    stream = server.service.Execute(execute_request(
        "tally", {"path": str(tmp_path / "tally"), "deltas": 0,
                  "gate": str(tmp_path / "never")}), _BareContext())
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the call admits its run and waits for the first time
    [run] = server.runtime.runs.values()
    assert not first.done()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first

    result = await asyncio.wait_for(run.wait(), 10)

    assert result.outcome == events_pb2.OUTCOME_CANCELLED
    assert result.error.code == "CLIENT_CANCELLED"
