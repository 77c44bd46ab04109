"""A store whose Redis went away still shuts down: every background loop (lease renewal,
flush, sweep, the approval poller) ends when stopped while its client keeps reconnecting to a
Redis that is gone. redis-py 8.0.x, which the MCP test extra installs, swallows a
cancellation that lands during a reconnect; a plain cancel-and-await then waited for ever."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from redis.asyncio import Redis
from structlog.testing import capture_logs

from stargrpc.stores.approvals import ApprovalRecord, now_ms
from stargrpc.stores.background import stop_background
from stargrpc.stores.redis import RedisRunStore
from stargrpc.v1 import events_pb2
from tests.helpers import eventually, free_port
from tests.stores.helpers import OwnRedis

#: Bound on the whole shutdown: each loop is sent its cancellation for at most ten seconds.
SHUTDOWN_WITHIN = 30


def _step_start() -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.step.phase = events_pb2.STEP_PHASE_START
    event.step.step.id = "s0"
    return event


async def test_every_loop_of_a_store_stops_while_its_redis_is_gone(tmp_path: Path) -> None:
    own = OwnRedis(free_port(), tmp_path)
    await own.start()
    redis = Redis.from_url(f"redis://127.0.0.1:{own.port}/0", socket_timeout=0.3,
                           socket_connect_timeout=0.3)
    store = RedisRunStore(redis, prefix=f"loops-{uuid.uuid4().hex[:8]}:", lease=1.0,
                          sweep_interval=0.05, timeout=0.3, flush_timeout=0.3)
    stopped = False
    try:
        await store.start()
        run_log = store.create(str(uuid.uuid4()), owner="alice", tool="tally")
        await store.publish(run_log)  # a live run: its lease is renewed in the background
        run_log.append_nowait(_step_start())
        assert await store.flushed(10)
        await store.approvals.put(ApprovalRecord(
            run_id=run_log.run_id, approval_id="a1", tool="deploy", owner="alice",
            principal="alice", digest="d" * 64, arguments="{}", requested_ms=now_ms(),
            deadline_ms=now_ms() + 60_000), 60_000)
        waiter = asyncio.create_task(store.approvals.wait(run_log.run_id, 60))  # the poller
        await eventually(lambda: store.approvals._poller is not None, within=10,
                         what="the approval poller started")
        own.stop()
        with capture_logs() as logs:
            run_log.append_nowait(_step_start())  # something for the flusher to retry
            await eventually(lambda: len([line for line in logs if line["event"] in (
                "redis_sweep_failed", "lease_renewal_failed")]) >= 3 or len(logs) >= 6,
                within=20, interval=0.05, what="the loops failing against the gone Redis")
        waiter.cancel()
        async with asyncio.timeout(SHUTDOWN_WITHIN):
            await asyncio.gather(waiter, return_exceptions=True)
            await store.stop_renewing()
            await store.flusher.stop()
            await store.approvals.aclose()
            await store.aclose()
        stopped = True
    finally:
        if not stopped:
            own.stop()
    assert not store.sweep.running


async def test_a_loop_that_swallows_a_cancellation_is_cancelled_again_until_it_ends() -> None:
    # What a client that turns a cancellation into its own error does to the loop above it
    # (redis-py 8.0.x reconnecting; asyncio.timeout racing a cancel on Python 3.11).
    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed < 3:
                    swallowed += 1  # taken for a failed round trip: the loop goes on
                    continue
                raise

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    async with asyncio.timeout(SHUTDOWN_WITHIN):
        await stop_background(task, "test-loop")
    assert task.cancelled() and swallowed == 3


async def test_a_loop_that_never_ends_is_given_up_on_bounded_and_logged() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    with capture_logs() as logs:
        async with asyncio.timeout(SHUTDOWN_WITHIN):
            await stop_background(task, "stubborn", attempts=3, wait=0.05)
    assert [line["loop"] for line in logs if line["event"] == "redis_loop_not_stopped"] == [
        "stubborn"]
    release.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_loop_that_ended_with_an_error_is_stopped_and_its_error_logged() -> None:
    async def failing() -> None:
        raise RuntimeError("last round trip failed")

    task = asyncio.create_task(failing())
    await asyncio.gather(task, return_exceptions=True)
    with capture_logs() as logs:
        await stop_background(task, "failing")
    assert [line["loop"] for line in logs if line["event"] == "redis_loop_ended_with_error"] == [
        "failing"]
    await stop_background(None, "never started")
