"""The blocking Client against a real server. The server runs on the test's event loop, so
each blocking call runs in a worker thread (as it would in a program without asyncio)."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest

from stargrpc.client import CallError, Client, Outcome, Result
from stargrpc.server.grpc_server import StargrpcServer
from tests.client.conftest import FAST_RETRY
from tests.client.faults import Proxy, Recorder
from tests.helpers import COUNT_TO_3, count_phases, phases


async def test_list_execute_call_watch_cancel(recorded_server: StargrpcServer,
                                              recorder: Recorder) -> None:
    def session() -> tuple[list[str], list, Result, list, bool, Result]:
        with Client(f"127.0.0.1:{recorded_server.port}", api_key="k") as client:
            names = client.list_tools().names
            events = list(client.execute("count", {"to": 3}))
            echoed = client.call("echo", {"text": "sync"})
            watched = list(client.watch(events[0].run_id, after_seq=5))
            sleeping = client.execute("sleep", {"seconds": 30, "heartbeat_every": 0.05})
            run_id = next(sleeping).run_id
            cancelled = client.cancel(run_id, "stop")
            last = list(sleeping)[-1]
            assert isinstance(last, Result)
            return names, events, echoed, watched, cancelled, last

    names, events, echoed, watched, cancelled, last = await asyncio.to_thread(session)

    assert {"count", "echo", "sleep"} <= set(names)
    assert phases([e.raw for e in events]) == COUNT_TO_3
    assert echoed.output == "sync"
    assert [e.seq for e in watched] == [6, 7, 8]
    assert cancelled and last.outcome is Outcome.CANCELLED
    assert {c.metadata["authorization"] for c in recorder.calls} == {"Bearer k"}


async def test_errors_reach_the_caller_and_the_client_stays_usable(
        recorded_server: StargrpcServer) -> None:
    def session() -> tuple[CallError, str]:
        with Client(f"127.0.0.1:{recorded_server.port}", retry=FAST_RETRY) as client:
            with pytest.raises(CallError) as raised:
                list(client.execute("no_such_tool"))
            for _ in client.execute("count", {"to": 50}):
                break  # leaving early cancels the stream
            return raised.value, client.call("echo", {"text": "after"}).output

    error, output = await asyncio.to_thread(session)

    assert error.code is grpc.StatusCode.NOT_FOUND
    assert output == "after"


async def test_injected_channel_and_resume_after_a_broken_stream(
        proxy: Proxy, recorder: Recorder) -> None:
    def session() -> list:
        events = []
        with Client(channel_factory=lambda: grpc.aio.insecure_channel(proxy.target),
                    retry=FAST_RETRY) as client:
            for event in client.execute("count", {"to": 6, "delay": 0.05}):
                events.append(event)
                if event.seq == 2:
                    proxy.cut()
        return events

    events = await asyncio.to_thread(session)

    assert phases([e.raw for e in events]) == count_phases(6)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len(recorder.seen("Execute")) == 1
    assert recorder.seen("WatchRun")


async def test_closing_the_client_ends_a_stream_the_caller_left_half_read(
        recorded_server: StargrpcServer) -> None:
    # As a program whose output pipe broke mid-stream: the iterator is never closed, the
    # client is. The stream's pump must end with the client rather than be destroyed
    # pending with the client's loop (which printed "Task was destroyed but it is pending").
    def session() -> tuple[int, int]:
        client = Client(f"127.0.0.1:{recorded_server.port}")
        sleeping = client.execute("sleep", {"seconds": 30, "heartbeat_every": 0.05})
        next(sleeping)
        open_before = len(client._pumps)
        client.close()
        left = len(client._pumps)
        del sleeping  # finalising the iterator now finds the client closed: nothing to do
        gc.collect()
        return open_before, left

    open_before, left = await asyncio.to_thread(session)

    assert (open_before, left) == (1, 0)
