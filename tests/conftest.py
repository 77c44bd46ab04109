"""Shared fixtures: a real grpc.aio server on 127.0.0.1:0 and a real channel to it."""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

from stargrpc.auth import KeyStore
from stargrpc.logs import configure_logging
from stargrpc.registry import Registry
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.settings import Settings
from stargrpc.v1 import tool_service_pb2_grpc
from tests.client_builds import build_go, node_cli_command
from tests.procs import ImageUser, image_user

ServerFactory = Callable[..., Awaitable[StargrpcServer]]

# Settings that mean "this test configures authentication itself".
_AUTH_SETTING_PREFIXES = ("insecure_no_auth", "keys_file", "auth_", "jwt_", "tls_", "mtls_")


_TRAVERSE_BITS_ADDED: dict[Path, int] = {}


def pytest_configure(config: pytest.Config) -> None:
    """Several tests run code as other users (the image's uid 10001, a sandbox uid, the
    postgres user) from this checkout and its virtual environment. A checkout under a
    private folder (``mktemp -d`` makes them 0700) would be out of their reach: for the
    run, each folder above the checkout and the interpreter gets the traverse bit for
    others (never read: nothing is listed), then its mode back. Done once, by the
    controlling process: with pytest-xdist, a worker that ended first must not take the
    bit back from one still running tests."""
    if os.geteuid() != 0 or hasattr(config, "workerinput"):
        return
    here = Path(__file__).resolve().parent.parent
    for start in (here, Path(sys.executable).resolve().parent):
        for folder in (start, *start.parents):
            mode = folder.stat().st_mode & 0o7777
            if folder not in _TRAVERSE_BITS_ADDED and not mode & 0o001:
                _TRAVERSE_BITS_ADDED[folder] = mode
                folder.chmod(mode | 0o001)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Gives back each folder's mode changed by :func:`pytest_configure`."""
    while _TRAVERSE_BITS_ADDED:
        folder, mode = _TRAVERSE_BITS_ADDED.popitem()
        folder.chmod(mode)


@pytest.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[ServerFactory]:
    """Starts servers on ephemeral ports: ``await make_server(registry=…, interceptors=…,
    **settings)`` (interceptors replace the configured chain).
    Every server it started is stopped at the end of the test."""
    started: list[StargrpcServer] = []

    async def factory(registry: Registry | None = None,
                      interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
                      **overrides: Any) -> StargrpcServer:
        # Authentication is off unless the test configures it (see make_auth_server).
        if not any(name.startswith(_AUTH_SETTING_PREFIXES) for name in overrides):
            overrides["insecure_no_auth"] = True
        # No warm pool unless the test asks for one: a pool starts sandboxes with every
        # server, and most tests start several servers.
        settings = Settings.load(**{"host": "127.0.0.1", "port": 0, "log_format": "json",
                                    "shutdown_grace_seconds": 2.0, "sandbox_warm_pool": 0,
                                    "state_dir": tmp_path / "state", **overrides})
        server = StargrpcServer(settings, registry=registry, interceptors=interceptors)
        await server.start()
        started.append(server)
        return server

    yield factory
    for server in started:
        await server.stop(grace=1.0)


@dataclass
class AuthServer:
    """A server with API-key authentication on, and a key (``roles`` of the factory) to call
    it with: ``async with key_channel(auth.target, auth.key) as chan`` (tests.helpers)."""

    server: StargrpcServer
    key: str
    keys: KeyStore

    @property
    def target(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.server.port}"

    def add_key(self, name: str, *roles: str) -> str:
        """Another key in the server's keys file (the server sees it on the next call)."""
        return self.keys.create(name, roles)[1]


AuthServerFactory = Callable[..., Awaitable[AuthServer]]


@pytest.fixture
async def make_auth_server(make_server: ServerFactory, tmp_path: Path) -> AuthServerFactory:
    """Starts servers with authentication ON: ``auth = await make_auth_server(registry=…,
    roles=("admin",), **settings)``; the key (named "tester") is ``auth.key``."""

    async def factory(registry: Registry | None = None, *, roles: Sequence[str] = ("admin",),
                      **overrides: Any) -> AuthServer:
        keys_file = Path(overrides.pop("keys_file", tmp_path / "keys.json"))
        store = KeyStore(keys_file)
        key = store.create("tester", roles)[1]
        server = await make_server(registry, insecure_no_auth=False, keys_file=keys_file,
                                   **overrides)
        return AuthServer(server, key, store)

    return factory


@pytest.fixture
async def server(make_server: ServerFactory) -> StargrpcServer:
    """A server with the bundled tools."""
    return await make_server()


@pytest.fixture
async def channel(server: StargrpcServer) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to :func:`server`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as chan:
        yield chan


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> tool_service_pb2_grpc.ToolServiceStub:
    """A ToolService stub on :func:`channel`."""
    return tool_service_pb2_grpc.ToolServiceStub(channel)


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """The server's log as JSON lines in a buffer (logging restored afterwards)."""
    buffer = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging("info", "json", stream=buffer)
    yield buffer
    structlog.reset_defaults()
    root.handlers[:], root.level = handlers, level


@pytest.fixture(scope="session")
def go_cli(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built ``stargrpc-go`` command."""
    return build_go("stargrpc-go", tmp_path_factory.mktemp("go"))


@pytest.fixture(scope="session")
def node_cli() -> list[str]:
    """``node clients/node/cli.js``, with its dependencies installed (``npm ci``)."""
    return node_cli_command()


@pytest.fixture
def image() -> Iterator[ImageUser]:
    """The way the container image runs the server: a non-root user, no bubblewrap on PATH
    (see :func:`tests.procs.image_user`); skipped unless the tests run as root."""
    if os.geteuid() != 0:
        pytest.skip("starts the server as another user (needs root)")
    with image_user() as user:
        yield user
