"""ListSessions in a fleet: a caller listing its sessions on any replica sees all of its
live sessions, whichever replica holds each (files listed by their holder), never another
principal's; stale entries of the fleet's index are dropped; Redis away is UNAVAILABLE."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis

from stargrpc.auth.fleet import FORWARDED_HEADER
from stargrpc.contract import SERVICE_NAME
from stargrpc.sessions.listing import MAX_LISTED
from stargrpc.v1 import events_pb2, tool_service_pb2
from tests.helpers import eventually, key_channel
from tests.sessions.conftest import REDIS_URL
from tests.sessions.fleet_helpers import (
    Fleet,
    MetadataRecorder,
    stub_of,
    target,
)
from tests.sessions.session_helpers import create, python


@pytest.fixture
def fleet(make_server, redis_prefix, tmp_path) -> Fleet:
    return Fleet(make_server, redis_prefix, tmp_path)


def index_key(prefix: str, principal: str) -> str:
    return f"{prefix}session-index:{hashlib.sha256(principal.encode()).hexdigest()[:32]}"


async def listing(channel: grpc.aio.Channel, **fields: Any
                  ) -> list[tool_service_pb2.Session]:
    reply = await stub_of(channel).ListSessions(
        tool_service_pb2.ListSessionsRequest(**fields), timeout=60)
    return list(reply.sessions)


def ids(sessions: list[tool_service_pb2.Session]) -> list[str]:
    return [s.session_id for s in sessions]


async def test_a_caller_sees_its_sessions_on_every_replica_from_any(fleet) -> None:
    a, b = await fleet.replica(), await fleet.replica()
    alice, bob = fleet.keys["alice"], fleet.keys["bob"]
    async with fleet_channels(a, b, alice) as (alice_a, alice_b), \
            fleet_channels(a, b, bob) as (bob_a, bob_b):
        on_a = await create(stub_of(alice_a))
        on_b = await create(stub_of(alice_b))
        bobs = await create(stub_of(bob_b))
        result = await python(stub_of(alice_a), on_a, "open('notes.txt', 'w').write('hi')")
        assert result.outcome == events_pb2.OUTCOME_OK
        for channel in (alice_a, alice_b):
            listed = await listing(channel)
            # Oldest first, whichever replica answers.
            assert ids(listed) == [on_a, on_b]
            assert [s.kind for s in listed] == ["python", "python"]
            assert listed[0].calls == 1 and listed[1].calls == 0
            assert all(s.expires_at.seconds > s.created_at.seconds for s in listed)
            # Files are listed by the replica whose disk holds them, through either.
            with_files = await listing(channel, with_files=True)
            assert [f.name for f in with_files[0].files] == ["notes.txt"]
            assert with_files[0].files[0].size == 2
        # Another principal's sessions are never shown, on either replica.
        for channel in (bob_a, bob_b):
            assert ids(await listing(channel)) == [bobs]
        # Closed through the replica that does not hold it: gone from every listing.
        await stub_of(alice_a).CloseSession(
            tool_service_pb2.CloseSessionRequest(session_id=on_b))
        for channel in (alice_a, alice_b):
            assert ids(await listing(channel)) == [on_a]


async def test_stale_and_foreign_index_entries_are_never_shown_and_are_dropped(
        fleet, redis_prefix) -> None:
    a, b = await fleet.replica(), await fleet.replica()
    alice, bob = fleet.keys["alice"], fleet.keys["bob"]
    redis = Redis.from_url(REDIS_URL)
    try:
        async with fleet_channels(a, b, alice) as (alice_a, alice_b), \
                fleet_channels(a, b, bob) as (_, bob_b):
            mine = await create(stub_of(alice_b))
            lost = await create(stub_of(alice_b))
            bobs = await create(stub_of(bob_b))
            key = index_key(redis_prefix, "alice")
            far = 2**52
            # What no replica put there: an id with no record, bob's session, an id past
            # its end, a huge member, a session whose holder's lease lapsed.
            await redis.zadd(key, {"ses_" + "0" * 32: far, bobs: far, "x" * 10_000: far,
                                   "ses_ended": 1})
            directory = b.service.sessions.directory
            directory._held.pop(lost)
            await redis.delete(f"{redis_prefix}session-lease:{lost}")
            assert ids(await listing(alice_a)) == [mine]
            left = {m.decode() for m in await redis.zrange(key, 0, -1)}
            assert left == {mine}
            # A lease that lapsed while its holder still holds the session (Redis was away
            # a while): the listing drops it, the holder's next renewal puts it back.
            await redis.delete(f"{redis_prefix}session-lease:{mine}")
            assert ids(await listing(alice_a)) == []

            async def back() -> bool:
                return ids(await listing(alice_a)) == [mine]

            await eventually(back, within=60, interval=0.2, what="the session listed again")
            # Bob's own index is untouched by alice's listing.
            assert ids(await listing(bob_b)) == [bobs]
    finally:
        await redis.aclose()


async def test_a_holder_that_cannot_be_reached_leaves_only_its_sessions_out(
        fleet, redis_prefix) -> None:
    a, b = await fleet.replica(), await fleet.replica()
    alice = fleet.keys["alice"]
    redis = Redis.from_url(REDIS_URL)
    try:
        async with fleet_channels(a, b, alice) as (alice_a, alice_b):
            here = await create(stub_of(alice_a))
            there = await create(stub_of(alice_b))
            # The record names a replica nobody listens on (its lease still current).
            await redis.set(f"{redis_prefix}session:{there}",
                            json.dumps({"replica": "127.0.0.1:1", "principal": "alice"}))
            assert ids(await listing(alice_a)) == [here]
            # The holder itself still lists it.
            assert ids(await listing(alice_b)) == [here, there]
    finally:
        await redis.aclose()


async def test_without_the_fleet_secret_only_this_replicas_sessions_are_listed(fleet) -> None:
    a = await fleet.replica(fleet_secret=None)
    b = await fleet.replica(fleet_secret=None)
    async with fleet_channels(a, b, fleet.keys["alice"]) as (alice_a, alice_b):
        here = await create(stub_of(alice_a))
        await create(stub_of(alice_b))
        assert ids(await listing(alice_a)) == [here]


async def test_a_stalled_redis_makes_the_listing_unavailable(make_server, tmp_path,
                                                             stallable_redis) -> None:
    fleet = Fleet(make_server, "stall:", tmp_path)
    fleet.common["redis_url"] = stallable_redis.url
    a = await fleet.replica(redis_timeout_seconds=0.5)
    b = await fleet.replica(redis_timeout_seconds=0.5)
    async with fleet_channels(a, b, fleet.keys["alice"]) as (alice_a, alice_b):
        await create(stub_of(alice_a))
        await create(stub_of(alice_b))
        assert len(await listing(alice_a)) == 2
        stallable_redis.stall()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await listing(alice_a)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            stallable_redis.resume()
        assert len(await listing(alice_a)) == 2


async def test_a_forwarded_listing_is_answered_by_the_replica_alone(fleet) -> None:
    """The holder is asked once, vouched for (never with the caller's token), and answers
    for itself alone: it never asks on."""
    recorders = MetadataRecorder(), MetadataRecorder()
    a = await fleet.replica(recorder=recorders[0])
    b = await fleet.replica(recorder=recorders[1])
    key = fleet.keys["alice"]
    async with fleet_channels(a, b, key) as (alice_a, alice_b):
        await create(stub_of(alice_a))
        await create(stub_of(alice_b))
        for recorder in recorders:
            recorder.calls.clear()
        assert len(await listing(alice_a)) == 2
        asked = [metadata for method, metadata in recorders[1].calls
                 if method.endswith("/ListSessions")]
        assert len(asked) == 1 and FORWARDED_HEADER in asked[0]
        assert "authorization" not in asked[0]
        assert all(key not in str(value) for value in asked[0].values())
        assert [m for m, _ in recorders[0].calls if m.endswith("/ListSessions")] == \
            [f"/{SERVICE_NAME}/ListSessions"]
        # A forged assertion is refused outright, never answered with a listing.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub_of(alice_a).ListSessions(
                tool_service_pb2.ListSessionsRequest(), timeout=60,
                metadata=((FORWARDED_HEADER, "v1.e30.AAAA"),))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_listing_works_on_a_redis_cluster(make_server, tmp_path,
                                                    redis_cluster) -> None:
    fleet = Fleet(make_server, "cluster:", tmp_path)
    fleet.common["redis_url"] = redis_cluster.url
    a, b = await fleet.replica(), await fleet.replica()
    async with fleet_channels(a, b, fleet.keys["alice"]) as (alice_a, alice_b):
        on_a = await create(stub_of(alice_a))
        on_b = await create(stub_of(alice_b))
        for channel in (alice_a, alice_b):
            assert ids(await listing(channel)) == [on_a, on_b]
        await stub_of(alice_b).CloseSession(
            tool_service_pb2.CloseSessionRequest(session_id=on_a))
        assert ids(await listing(alice_b)) == [on_b]


@contextlib.asynccontextmanager
async def fleet_channels(a: Any, b: Any, key: str
                         ) -> AsyncIterator[tuple[grpc.aio.Channel, grpc.aio.Channel]]:
    """Channels to two replicas, both calling with ``key``."""
    async with key_channel(target(a), key) as on_a, key_channel(target(b), key) as on_b:
        yield on_a, on_b


async def test_a_flooded_index_is_read_up_to_its_bound_and_cleaned(fleet, redis_prefix
                                                                  ) -> None:
    a, b = await fleet.replica(), await fleet.replica()
    redis = Redis.from_url(REDIS_URL)
    try:
        async with fleet_channels(a, b, fleet.keys["alice"]) as (alice_a, alice_b):
            mine = await create(stub_of(alice_b))
            key = index_key(redis_prefix, "alice")
            flood = {f"ses_{i:032x}": 2**52 for i in range(MAX_LISTED + 5)}
            await redis.zadd(key, flood)
            # Read up to the bound (the real session, ending soonest, first), cleaned as read.
            assert ids(await listing(alice_a)) == [mine]
            # The real one and MAX_LISTED - 1 of the flood were read: 6 were not.
            assert await redis.zcard(key) == 1 + 6
            assert ids(await listing(alice_a)) == [mine]
            assert await redis.zcard(key) == 1
    finally:
        await redis.aclose()
