"""How the Redis store writes runs: a run without a key reaches Redis only with its first
events (registered by the same script call), concurrent runs share the flusher's round trips
beyond the connection pool's size, a Redis that lost its scripts is handled, and a run is
refused while Redis is unreachable."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from structlog.testing import capture_logs

from stargrpc.errors import Unavailable
from stargrpc.ids import new_id
from stargrpc.principal import Principal, current_principal
from stargrpc.settings import Settings
from stargrpc.stores.redis import RedisRunLog, RedisRunStore
from stargrpc.stores.redis import store as redis_store
from stargrpc.v1 import events_pb2
from tests.helpers import eventually, free_port
from tests.stores.conftest import REDIS_URL
from tests.stores.helpers import OwnRedis


@pytest.fixture
async def store(redis_prefix: str) -> AsyncIterator[RedisRunStore]:
    """A store on the real Redis under this test's prefix."""
    run_store = RedisRunStore(Redis.from_url(REDIS_URL), prefix=redis_prefix)
    yield run_store
    await run_store.aclose()


def _step(phase: int) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.step.phase = phase  # type: ignore[assignment]
    event.step.step.id = "s0"
    return event


def _result() -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.result.outcome = events_pb2.OUTCOME_OK
    return event


async def _published(store: RedisRunStore, owner: str = "alice") -> RedisRunLog:
    run_log = store.create(uuid.uuid4().hex, owner=owner, tool="echo")
    await store.publish(run_log)
    return run_log


def _run_whole(run_log: RedisRunLog) -> None:
    for event in (_step(events_pb2.STEP_PHASE_START), _step(events_pb2.STEP_PHASE_END),
                  _result()):
        run_log.append_nowait(event)


async def test_a_run_without_key_reaches_redis_with_its_first_events(
        store: RedisRunStore, redis_prefix: str) -> None:
    redis = store.redis
    run_log = await _published(store)
    meta = f"{redis_prefix}run:{run_log.run_id}"
    events = f"{meta}:events"
    before = await redis.exists(meta, events, f"{meta}:lease")
    run_log.append_nowait(_step(events_pb2.STEP_PHASE_START))
    assert await store.flushed(10)
    running = await redis.hgetall(meta)
    leased = await redis.pttl(f"{meta}:lease")
    run_log.append_nowait(_step(events_pb2.STEP_PHASE_END))
    run_log.append_nowait(_result())
    assert await store.flushed(10)
    finished = await redis.hgetall(meta)
    entries: Any = await redis.xrange(events)  # the client's reply types are loose
    stored = [events_pb2.RunEvent.FromString(fields[b"e"]) for _, fields in entries]
    lease_left = await redis.exists(f"{meta}:lease")

    assert before == 0  # publishing wrote nothing: no round trip before the run starts
    assert running == {b"owner": b"alice", b"tool": b"echo", b"replica": store.replica.encode(),
                       b"state": b"running", b"summary": b'{"seq": 1, "step": ""}'}
    assert leased > 0
    assert finished[b"state"] == b"finished"
    assert [e.seq for e in stored] == [1, 2, 3] and stored[-1].HasField("result")
    assert lease_left == 0
    assert await redis.pttl(meta) > 0 and await redis.pttl(events) > 0
    # ListRuns finds it by its start, in every run's index and its principal's.
    for index in store.index.keys_of("alice"):
        assert await redis.zscore(index, run_log.run_id) == run_log.started_ms


async def test_a_run_that_loses_its_claim_leaves_nothing_in_redis(
        store: RedisRunStore, redis_prefix: str) -> None:
    winner, loser = await _published(store), await _published(store)
    won = await store.claim("alice", "k1", "fp", winner)
    lost = await store.claim("alice", "k1", "fp", loser)
    await store.discard(loser)
    _run_whole(winner)
    assert await store.flushed(10)
    keys = {k.decode() async for k in store.redis.scan_iter(match=f"{redis_prefix}run:*",
                                                            count=1000)}

    assert won.won and not lost.won and lost.run_id == winner.run_id
    assert keys == {f"{redis_prefix}run:{winner.run_id}",
                    f"{redis_prefix}run:{winner.run_id}:events"}


async def test_more_concurrent_runs_than_pooled_connections_all_reach_redis(
        store: RedisRunStore) -> None:
    # redis-py's pool holds 100 connections; a write per run at once would exceed it.
    runs = [await _published(store, owner=f"p{i}") for i in range(250)]
    with capture_logs() as logs:
        for run_log in runs:
            _run_whole(run_log)
        assert await store.flushed(30)
    other = RedisRunStore(store.redis, prefix=store.prefix)
    opened = [await other.open(run_log.run_id) for run_log in runs]

    assert [entry for entry in logs if entry["log_level"] != "debug"] == []
    assert all(o is not None and o.finished and o.last_seq == 3 for o in opened)
    assert {o.owner for o in opened if o is not None} == {f"p{i}" for i in range(250)}


async def test_a_redis_that_lost_its_scripts_gets_them_again(tmp_path: Path) -> None:
    own = OwnRedis(free_port(), tmp_path)
    await own.start()
    url = f"redis://127.0.0.1:{own.port}/0"
    store = RedisRunStore(Redis.from_url(url))
    try:
        first = await _published(store)
        _run_whole(first)
        assert await store.flushed(10)
        await store.redis.script_flush()  # as a restarted Redis: no scripts loaded
        second = await _published(store)
        _run_whole(second)
        assert await store.flushed(10)
        opened = await RedisRunStore(store.redis).open(second.run_id)
    finally:
        await store.aclose()
        own.stop()

    assert opened is not None and opened.finished and opened.last_seq == 3


async def test_the_flusher_reconnects_when_its_connection_is_cut(tmp_path: Path) -> None:
    # A Redis of the test's own: cutting connections on the shared one would cut everybody's.
    own = OwnRedis(free_port(), tmp_path)
    await own.start()
    store = RedisRunStore(Redis.from_url(f"redis://127.0.0.1:{own.port}/0"))
    try:
        first = await _published(store)
        _run_whole(first)
        assert await store.flushed(10)
        # Cut every connection of the flusher's client (as a Redis restart or a proxy would).
        await store.redis.client_kill_filter(_type="normal", skipme=True)

        second = await _published(store)
        _run_whole(second)
        assert await store.flushed(10)
        opened = await RedisRunStore(store.redis).open(second.run_id)
    finally:
        await store.aclose()
        own.stop()

    assert opened is not None and opened.finished and opened.last_seq == 3


async def test_a_run_is_refused_while_redis_is_unreachable() -> None:
    store = RedisRunStore(Redis.from_url(f"redis://127.0.0.1:{free_port()}/0",
                                         socket_connect_timeout=2))
    try:
        with pytest.raises(Unavailable) as caught:
            await _published(store)
    finally:
        await store.aclose()

    assert caught.value.reason == "RUN_STORE_UNAVAILABLE"


async def test_after_a_failed_write_runs_are_refused_until_redis_answers_again(
        tmp_path: Path) -> None:
    own = OwnRedis(free_port(), tmp_path)
    await own.start()
    store = RedisRunStore(Redis.from_url(f"redis://127.0.0.1:{own.port}/0",
                                         socket_connect_timeout=2))
    try:
        _run_whole(await _published(store))
        assert await store.flushed(10)
        unseen = await _published(store)  # accepted: nothing has failed yet
        own.stop()
        _run_whole(unseen)
        # Its write fails in the background: no event tells of that.
        await eventually(lambda: not store.healthy, within=5, what="the failed write noted")
        with pytest.raises(Unavailable) as refused:
            await _published(store)
        await own.start()
        after = await _published(store)
        _run_whole(after)
        assert await store.flushed(10)  # the failed run is written too, once Redis is back
        opened = [await RedisRunStore(store.redis).open(r.run_id) for r in (unseen, after)]
    finally:
        await store.aclose()
        own.stop()

    assert refused.value.reason == "RUN_STORE_UNAVAILABLE"
    assert all(o is not None and o.finished and o.last_seq == 3 for o in opened)


async def test_only_the_flusher_goes_without_a_socket_timeout(redis_prefix: str) -> None:
    # The flusher bounds each round trip itself (one timer); redis-py would add a task per
    # command to enforce a socket timeout. Every other command keeps failing fast.
    store = RedisRunStore.from_settings(
        Settings.load(redis_url=REDIS_URL, redis_key_prefix=redis_prefix))
    try:
        run_log = await _published(store)
        _run_whole(run_log)
        assert await store.flushed(10)
        assert store.flusher.line.socket_timeout is None
        assert store.redis.connection_pool.connection_kwargs["socket_timeout"] > 0
        assert store.flush_timeout > 0
    finally:
        await store.aclose()


async def test_forged_fresh_run_ids_hold_at_most_so_many_redis_waits(store: RedisRunStore,
                                                                      monkeypatch) -> None:
    # An attacker names ids that look minted a moment ago, of runs that do not exist: each
    # lookup would block on Redis for the first-write window. Only MAX_FRESH_RUN_WAITS do;
    # the next is answered at once, while those still wait.
    monkeypatch.setattr(redis_store, "MAX_FRESH_RUN_WAITS", 4)
    waiting = [asyncio.create_task(store.open(new_id())) for _ in range(4)]
    await eventually(lambda: store._fresh_waits == 4, within=10,
                     what="all four lookups waiting on Redis")
    extra = asyncio.create_task(store.open(new_id()))
    try:
        done, _ = await asyncio.wait([extra, *waiting], return_when=asyncio.FIRST_COMPLETED)
        assert done == {extra}
        assert extra.result() is None
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    assert store._fresh_waits == 0


async def test_one_principal_holds_only_its_share_of_the_fresh_run_waits(
        store: RedisRunStore, monkeypatch) -> None:
    # One caller naming forged fresh ids takes at most its share of the waits: another's
    # lookup of a run just admitted elsewhere still waits for its first write.
    monkeypatch.setattr(redis_store, "MAX_FRESH_RUN_WAITS", 8)
    monkeypatch.setattr(redis_store, "MAX_FRESH_RUN_WAITS_PER_PRINCIPAL", 2)

    def as_caller(name: str) -> asyncio.Task[Any]:
        token = current_principal.set(Principal(id=name, roles=frozenset(), method="api_key"))
        try:  # the task takes a copy of the context as it is now
            return asyncio.create_task(store.open(new_id()))
        finally:
            current_principal.reset(token)

    mallory = [as_caller("mallory") for _ in range(2)]
    await eventually(lambda: store._fresh_waits == 2, within=10,
                     what="mallory's two lookups waiting on Redis")
    beyond = as_caller("mallory")
    alice = as_caller("alice")
    try:
        done, _ = await asyncio.wait([beyond, alice, *mallory],
                                     return_when=asyncio.FIRST_COMPLETED)
        assert done == {beyond} and beyond.result() is None
        await eventually(lambda: store._fresh_waits == 3, within=10,
                         what="alice's lookup waiting beside mallory's two")
    finally:
        for task in [*mallory, alice]:
            task.cancel()
        await asyncio.gather(*mallory, alice, return_exceptions=True)
    assert store._fresh_waits == 0 and store._fresh_waits_by == {}
