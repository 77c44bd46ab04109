"""The in-memory run store: gapless logs, replay and follow, retention, claims that expire
with their run, and the slow-follower rule."""

from __future__ import annotations

import asyncio
import time

import pytest

from stargrpc.errors import WatcherTooSlow
from stargrpc.stores.base import ENCODED_KEEP_BYTES, RunQuery
from stargrpc.stores.memory import MemoryRunStore
from stargrpc.v1 import events_pb2


def heartbeat(text: str = "") -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.heartbeat.message = text
    return event


def result() -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.result.outcome = events_pb2.OUTCOME_OK
    return event


async def test_seq_is_gapless_and_nothing_follows_the_result() -> None:
    log = MemoryRunStore().create("r1", owner="alice", tool="t")
    for i in range(3):
        await log.append(heartbeat(str(i)))
    await log.append(result())

    with pytest.raises(RuntimeError):
        await log.append(heartbeat())
    events = [e async for e in log.follow(0)]
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert {e.run_id for e in events} == {"r1"}
    assert [e.seq async for e in log.follow(2)] == [3, 4]
    assert [e async for e in log.follow(99)] == []
    assert (log.owner, log.tool, log.finished, log.last_seq) == ("alice", "t", True, 4)


async def test_a_follower_gets_live_events_until_the_result() -> None:
    log = MemoryRunStore().create("r1")
    await log.append(heartbeat("before"))
    got: list[int] = []

    async def follow() -> None:
        async for event in log.follow(0):
            got.append(event.seq)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0)  # let it catch up and wait
    await log.append(heartbeat("live"))
    await log.append(result())
    await asyncio.wait_for(task, 5)

    assert got == [1, 2, 3]


async def test_finished_runs_expire_and_take_their_claim_with_them() -> None:
    store = MemoryRunStore(retention=0)
    first = store.create("r1", owner="alice")
    claim = await store.claim("alice", "k", "fp", first)
    again = await store.claim("alice", "k", "fp", store.create("r2", owner="alice"))
    other = await store.claim("bob", "k", "fp", store.create("r3", owner="bob"))
    await first.append(result())

    assert claim.won and not again.won and again.run_id == "r1" and other.won
    assert await store.open("r1") is None  # retention 0: gone at the next look
    renewed = await store.claim("alice", "k", "fp", store.create("r4", owner="alice"))
    assert renewed.won and renewed.run_id == "r4"


async def test_at_most_max_finished_runs_are_kept() -> None:
    store = MemoryRunStore(max_finished=2)
    for i in range(4):
        await store.create(f"r{i}").append(result())
    store.create("live")

    assert [await store.open(f"r{i}") is not None for i in range(4)] == [
        False, False, True, True]
    assert len(store) == 3


async def test_a_follower_that_falls_behind_a_live_run_is_told_where_to_resume() -> None:
    log = MemoryRunStore().create("r1")
    follower = log.follow(0, max_lag=5)
    await log.append(heartbeat())
    assert (await anext(follower)).seq == 1
    waiting = asyncio.ensure_future(anext(follower))
    await asyncio.sleep(0)  # let it catch up and wait
    await log.append(heartbeat())
    assert (await waiting).seq == 2
    for _ in range(10):  # the follower is not reading now
        await log.append(heartbeat())

    with pytest.raises(WatcherTooSlow) as caught:
        await anext(follower)
    assert caught.value.resume_after == 2
    replay = log.follow(0, max_lag=5)  # replaying from the start is not "too slow"
    assert [(await anext(replay)).seq for _ in range(12)] == list(range(1, 13))


async def test_a_follower_cancelled_while_waiting_leaves_the_others_waiting() -> None:
    log = MemoryRunStore().create("r1")
    first, second = log.follow_batches(0), log.follow_batches(0)
    cancelled = asyncio.ensure_future(anext(first))
    waiting = asyncio.ensure_future(anext(second))
    await asyncio.sleep(0)  # both caught up: each waits for the next event
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    log.append_nowait(heartbeat("a"))
    assert [e.seq for e in await asyncio.wait_for(waiting, 10)] == [1]
    # The cancelled one follows on from where it was.
    assert [e.seq for e in await anext(first)] == [1]
    log.append_nowait(result())
    assert [e.seq for e in await anext(second)] == [2]
    with pytest.raises(StopAsyncIteration):
        await anext(second)


async def test_followers_that_come_and_go_on_a_quiet_run_leave_nothing_behind() -> None:
    log = MemoryRunStore().create("r1")
    for _ in range(50):  # watchers of a run that says nothing for a long while
        waiting = asyncio.ensure_future(anext(log.follow_batches(0)))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert log._waiters == []


async def test_batches_hold_every_waiting_event_and_bytes_are_made_once() -> None:
    log = MemoryRunStore().create("r1")
    log.append_nowait(heartbeat("a"))
    batches = log.follow_batches(0)
    assert [e.seq for e in await anext(batches)] == [1]
    waiting = asyncio.ensure_future(anext(batches))
    await asyncio.sleep(0)  # let it catch up and wait
    log.append_nowait(heartbeat("b"))
    log.append_nowait(heartbeat("x" * (ENCODED_KEEP_BYTES + 1)))
    log.append_nowait(result())
    assert [e.seq for e in await waiting] == [2, 3, 4]  # one wake-up, all three

    assert log.encoded(2) is log.encoded(2)  # kept, shared by every reader
    assert log.encoded(3) is not log.encoded(3)  # too big to keep twice
    assert events_pb2.RunEvent.FromString(log.encoded(3)).heartbeat.message.startswith("xx")
    with pytest.raises(IndexError):
        log.encoded(5)


async def test_events_are_stamped_with_the_current_time() -> None:
    log = MemoryRunStore().create("r1")
    before = time.time_ns()
    event = log.append_nowait(heartbeat())
    after = time.time_ns()
    assert before <= event.time.ToNanoseconds() <= after
    assert 0 <= event.time.nanos < 1_000_000_000


async def test_finished_runs_are_bounded_by_bytes_oldest_first() -> None:
    store = MemoryRunStore(max_finished_bytes=25_000)
    for index in range(5):
        log = store.create(f"r{index}")
        await log.append(heartbeat("x" * 10_000))
        await log.append(result())
        assert 10_000 < log.size < 10_100

    # Three runs are over the bound: the two oldest went as the newer ones finished.
    assert [run_id for run_id in ("r0", "r1", "r2", "r3", "r4") if store.get(run_id)] == [
        "r3", "r4"]
    assert store.finished_bytes < 25_000
    running = store.create("live")
    await running.append(heartbeat("y" * 50_000))  # a run in flight counts for nothing
    assert store.get("r3") is not None


async def test_the_newest_finished_run_stays_however_large() -> None:
    store = MemoryRunStore(max_finished_bytes=1000)
    for run_id in ("old", "big"):
        log = store.create(run_id)
        await log.append(heartbeat("x" * 5000))
        await log.append(result())

    assert store.get("old") is None and store.get("big") is not None


@pytest.mark.parametrize("reader", ["none", "some encoded", "waiting follower"])
async def test_a_finished_log_is_sized_by_its_events_whoever_read_them(reader: str) -> None:
    log = MemoryRunStore().create("r1")
    log.append_nowait(heartbeat("a"))
    log.append_nowait(heartbeat("x" * (ENCODED_KEEP_BYTES + 1)))
    log.append_nowait(heartbeat("b"))
    waiting = None
    if reader == "some encoded":
        log.encoded(1)
        log.encoded(2)
    elif reader == "waiting follower":
        batches = log.follow_batches(3)
        waiting = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0)  # caught up: it waits for the next event
    log.append_nowait(result())

    events = [e async for e in log.follow(0)]
    assert log.size == sum(event.ByteSize() for event in events)
    # The bytes the run's own stream asks for next were made while sizing them, and kept,
    # whoever read before; an event too large to keep twice still is not, and the Result
    # (sent as a message of its own) is only sized.
    made = [data is not None for data in log._encoded]
    assert made == [True, False, True, False]
    assert log.encoded(2) is not log.encoded(2)
    assert [events_pb2.RunEvent.FromString(log.encoded(seq)) for seq in (1, 2, 3, 4)] == events
    if waiting is not None:
        assert [e.seq for e in await waiting] == [4]


async def test_pages_list_every_run_started_in_one_millisecond() -> None:
    # Ids are not ordered within a millisecond: runs created "b", "c", "a" in the same one
    # are listed c, b, a (the cursor's order), and every page picks up where the last one
    # ended; in creation order the page after "a" skipped "c".
    store = MemoryRunStore()
    for run_id in ("b", "c", "a"):
        store.create(run_id, owner="alice").started_ms = 1_795_000_000_000

    listed: list[str] = []
    after = None
    for _ in range(5):
        page = await store.list_runs(RunQuery(owner=None, limit=1, after=after))
        listed += [run.run_id for run in page.runs]
        if page.cursor is None:
            break
        after = page.cursor

    assert listed == ["c", "b", "a"]
