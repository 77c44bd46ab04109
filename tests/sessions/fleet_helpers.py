"""Replicas of a fleet for the session tests: started on the real Redis (or one a test
names) with a folder each, API keys for alice and bob, and what each replica receives
recorded when a test asks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from stargrpc.auth.keys import KeyStore
from stargrpc.server.interceptors import build_chain
from stargrpc.settings import Settings
from stargrpc.v1 import tool_service_pb2_grpc
from tests.stores.conftest import REDIS_URL

FLEET_SECRET = "a-fleet-secret-for-the-forwarding-tests"


class MetadataRecorder(grpc.aio.ServerInterceptor):
    """Records the method and metadata of every call a server receives, before anything
    else sees it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails
                                ) -> Any:
        self.calls.append((details.method, dict(details.invocation_metadata or ())))
        return await continuation(details)


class Fleet:
    """Replicas sharing the real Redis under the test's prefix, each with a folder of its
    own (its own audit trail), and API keys for alice and bob."""

    def __init__(self, make_server: Any, redis_prefix: str, tmp_path: Path) -> None:
        self._make_server, self._tmp_path = make_server, tmp_path
        self.keys_file = tmp_path / "keys.json"
        store = KeyStore(self.keys_file)
        self.keys = {name: store.create(name, ("admin",))[1] for name in ("alice", "bob")}
        self.common: dict[str, Any] = {
            "insecure_no_auth": False, "keys_file": self.keys_file, "redis_url": REDIS_URL,
            "redis_key_prefix": redis_prefix, "session_advertise_address": "127.0.0.1:0",
            "sandbox_max_processes": 32}
        self._count = 0

    async def replica(self, *, recorder: MetadataRecorder | None = None, **overrides: Any
                      ) -> Any:
        self._count += 1
        settings = {**self.common, "fleet_secret": FLEET_SECRET,
                     "state_dir": self._tmp_path / f"replica-{self._count}", **overrides}
        settings = {k: v for k, v in settings.items() if v is not None}
        interceptors = None
        if recorder is not None:  # first in the chain: sees what arrives, untouched
            interceptors = [recorder, *build_chain(Settings.load(host="127.0.0.1", port=0,
                                                                 **settings))]
        return await self._make_server(interceptors=interceptors, **settings)


def stub_of(channel: grpc.aio.Channel) -> tool_service_pb2_grpc.ToolServiceStub:
    return tool_service_pb2_grpc.ToolServiceStub(channel)


def target(server: Any) -> str:
    return f"127.0.0.1:{server.port}"
