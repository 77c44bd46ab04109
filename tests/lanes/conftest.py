"""Fixtures of the lane tests: the Holds of the test, a server with lanes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from stargrpc.registry import Registry
from stargrpc.server.grpc_server import StargrpcServer
from tests.lanes.lane_helpers import HOLDS, Holds, lane_registry, lane_settings
from tests.runs_support import HeaderPrincipal
from tests.stores.conftest import REDIS_URL, redis_cluster, redis_prefix  # noqa: F401


@pytest.fixture
def holds() -> Holds:
    """What the test's ``hold`` runs wait for."""
    held = Holds()
    HOLDS.append(held)
    yield held
    HOLDS.remove(held)
    for event in held._events.values():
        event.set()


LaneServer = Callable[..., Awaitable[tuple[StargrpcServer, grpc.aio.Channel]]]


@pytest.fixture
async def lane_server(make_server: Any, holds: Holds) -> AsyncIterator[LaneServer]:
    """``server, channel = await lane_server(**settings)``: the lane tools, lanes ``slow``
    and ``timed`` of one slot, callers named by the x-test-principal header."""
    channels: list[grpc.aio.Channel] = []

    async def start(lanes: dict[str, Any] | None = None, registry: Registry | None = None,
                    **settings: Any) -> tuple[StargrpcServer, grpc.aio.Channel]:
        server = await make_server(registry=registry or lane_registry(),
                                   interceptors=[HeaderPrincipal()],
                                   **{**lane_settings(**(lanes or {})), **settings})
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        channels.append(channel)
        return server, channel

    yield start
    for held in HOLDS:
        held.release(*list(held._events))
    for channel in channels:
        await channel.close()


@pytest.fixture(params=["memory", "redis", "cluster"])
def lanes_at(request: pytest.FixtureRequest, lane_server: LaneServer,
             redis_prefix: str) -> LaneServer:  # noqa: F811 (a fixture)
    """:func:`lane_server` with its lanes in one process, in Redis, or in a Redis Cluster."""
    if request.param == "memory":
        return lane_server
    url, prefix = REDIS_URL, redis_prefix
    if request.param == "cluster":
        url, prefix = request.getfixturevalue("redis_cluster").url, "stargrpc:"

    async def start(**settings: Any) -> tuple[StargrpcServer, grpc.aio.Channel]:
        return await lane_server(redis_url=url, redis_key_prefix=prefix, **settings)

    return start


@pytest.fixture(params=["redis", "cluster"])
def fleet_store(request: pytest.FixtureRequest, redis_prefix: str  # noqa: F811 (a fixture)
                ) -> tuple[str, str]:
    """The Redis URL and key prefix replicas share: one Redis, or a Redis Cluster."""
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster").url, "stargrpc:"
    return REDIS_URL, redis_prefix


@pytest.fixture
async def fleet(lane_server: LaneServer, fleet_store: tuple[str, str]) -> LaneServer:
    """``server, channel = await fleet(**settings)``: replicas of :func:`lane_server` that
    share runs and lanes in Redis (:func:`fleet_store`)."""
    url, prefix = fleet_store

    async def start(**settings: Any) -> tuple[StargrpcServer, grpc.aio.Channel]:
        return await lane_server(redis_url=url, redis_key_prefix=prefix, **settings)

    return start
