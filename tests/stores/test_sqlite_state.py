"""Run state kept across restarts (stores/sqlite_state.py, ``state_persist``): a restarted
server finds what tools kept, and only when the operator asked; the SQLite store keeps the
memory store's semantics (compare_and_set, increments, quotas, ttls, retention), and a
broken database is STATE_UNAVAILABLE, not a crash."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest

from stargrpc.errors import Unavailable
from stargrpc.stores.base import (
    STATE_MISMATCH,
    STATE_NOT_INTEGER,
    STATE_OVER_QUOTA,
    STATE_WRITTEN,
    StateWrite,
)
from stargrpc.stores.memory import MemoryStateStore
from stargrpc.stores.sqlite_state import SqliteStateStore
from stargrpc.v1 import tool_service_pb2_grpc
from tests.helpers import eventually
from tests.runs_support import HeaderPrincipal
from tests.state_tools import call_state_tool, state_registry, value_of


async def _stub(make_server: Any, **settings: Any) -> tuple[Any, Any]:
    server = await make_server(registry=state_registry(), interceptors=[HeaderPrincipal()],
                               **settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return server, tool_service_pb2_grpc.ToolServiceStub(channel)


@pytest.mark.parametrize("persist", [True, False])
async def test_state_outlives_a_restart_only_when_asked(make_server, persist: bool) -> None:
    server, stub = await _stub(make_server, state_persist=persist)
    await call_state_tool(stub, scope="principal", op="set", key="seen", value=["a", "b"])
    await call_state_tool(stub, scope="principal", op="increment", key="n", by=7)
    await server.stop(grace=1)

    _, stub = await _stub(make_server, state_persist=persist)  # the same state_dir
    kept = value_of(await call_state_tool(stub, scope="principal", op="get", key="seen"))
    assert kept == (["a", "b"] if persist else None)
    assert value_of(await call_state_tool(stub, scope="principal", op="increment",
                                          key="n")) == (8 if persist else 1)
    assert (server.settings.state_dir / "state.db").exists() is persist


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_both_embedded_stores_answer_alike(tmp_path: Path, kind: str) -> None:
    store = {"memory": MemoryStateStore, "sqlite": lambda: SqliteStateStore(
        tmp_path / "state.db")}[kind]()
    quota = StateWrite(max_scope_bytes=20)
    assert await store.put("run:r1", "k", '"v"', quota, conditional=True) == STATE_WRITTEN
    assert await store.put("run:r1", "k", '"w"', quota, conditional=True) == STATE_MISMATCH
    assert await store.put("run:r1", "k", '"w"', quota, conditional=True,
                           expected='"v"') == STATE_WRITTEN
    assert await store.get("run:r1", "k") == '"w"'
    assert await store.increment("run:r1", "n", 5, quota) == 5
    assert await store.increment("run:r1", "k", 1, quota) == STATE_NOT_INTEGER
    assert await store.increment("run:r1", "n", 2**53, quota) == STATE_NOT_INTEGER
    # 1 + 3 and 1 + 1 bytes held; 20 allowed.
    assert await store.put("run:r1", "big", '"' + "x" * 14 + '"', quota) == STATE_OVER_QUOTA
    assert await store.put("run:r1", "fits", '"' + "x" * 8 + '"', quota) == STATE_WRITTEN
    assert await store.keys("run:r1", "") == ["fits", "k", "n"]
    assert await store.keys("run:r1", "f") == ["fits"]
    assert await store.keys("run:r2", "") == []
    assert await store.delete("run:r1", "fits") is True
    assert await store.delete("run:r1", "fits") is False
    # An entry's ttl, then the scope's retention once it ends.
    await store.put("run:r1", "brief", "1", StateWrite(ttl_ms=50))
    await eventually(lambda: _gone(store, "run:r1", "brief"), what="the entry's ttl")
    await store.end_scope("run:r1", 50)
    await eventually(lambda: _gone(store, "run:r1", "k"), what="the scope's retention")
    assert await store.keys("run:r1", "") == []


async def _gone(store: Any, scope: str, key: str) -> bool:
    return await store.get(scope, key) is None


async def test_entries_expire_by_the_wall_clock_across_a_restart(tmp_path: Path) -> None:
    first = SqliteStateStore(tmp_path / "state.db")
    await first.put("principal:p", "short", "1", StateWrite(ttl_ms=50))
    await first.put("principal:p", "long", "2", StateWrite())
    first.close()
    await asyncio.sleep(0.1)  # the ttl runs out while no server runs
    second = SqliteStateStore(tmp_path / "state.db")
    assert await second.keys("principal:p", "") == ["long"]
    assert await second.get("principal:p", "short") is None
    second.close()


async def test_a_broken_database_is_unavailable(tmp_path: Path) -> None:
    store = SqliteStateStore(tmp_path / "state.db")
    await store.put("global", "k", "1", StateWrite())
    with sqlite3.connect(tmp_path / "state.db") as other:
        other.execute("DROP TABLE state_entries")
    with pytest.raises(Unavailable, match="run state database failed"):
        await store.get("global", "k")
    store.close()
