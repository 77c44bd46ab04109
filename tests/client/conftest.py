"""Fixtures of the client tests: a server with a call recorder, and clients on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from stargrpc.client import AsyncClient, RetryPolicy
from stargrpc.server.grpc_server import StargrpcServer
from tests.client.faults import Proxy, Recorder
from tests.conftest import ServerFactory

#: Quick retries, so the tests that exercise them stay fast.
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.02, max_backoff=0.2)


@pytest.fixture
def recorder() -> Recorder:
    """Records the calls the server receives; can refuse the next ones."""
    return Recorder()


@pytest.fixture
async def recorded_server(make_server: ServerFactory, recorder: Recorder) -> StargrpcServer:
    """A server with the bundled tools, its calls recorded by :func:`recorder`."""
    return await make_server(interceptors=[recorder])


@pytest.fixture
async def client(recorded_server: StargrpcServer) -> AsyncIterator[AsyncClient]:
    """An AsyncClient on an injected channel to :func:`recorded_server`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{recorded_server.port}") as channel:
        yield AsyncClient(channel, api_key="test-key", retry=FAST_RETRY)


@pytest.fixture
async def proxy(recorded_server: StargrpcServer) -> AsyncIterator[Proxy]:
    """A TCP proxy in front of :func:`recorded_server` whose connections can be cut."""
    front = Proxy(recorded_server.port)
    await front.start()
    yield front
    await front.close()
