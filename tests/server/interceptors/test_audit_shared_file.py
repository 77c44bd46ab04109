"""Two server processes sharing one SQLite audit file, both under load: each appends on its
event loop while it holds the write lock and hands over to its store's thread while the
other does, and the two still build one intact chain holding every call."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc

from stargrpc.audit.chain import verify
from stargrpc.audit.key import default_key_path, load_key
from stargrpc.audit.store import open_store
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.procs import serve

CLIENTS_PER_SERVER = 6
CALLS_PER_CLIENT = 40  # bounded in count ...
MAX_SECONDS = 60.0  # ... and in time


async def _load(target: str, tag: str, results: set[str]) -> None:
    stop_at = time.monotonic() + MAX_SECONDS
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)

        async def client(number: int) -> None:
            for i in range(CALLS_PER_CLIENT):
                if time.monotonic() > stop_at:
                    return
                request = tool_service_pb2.ExecuteRequest(
                    tool_name="echo", arguments_json=json.dumps({"text": f"{tag}{number}-{i}"}))
                async for response in stub.Execute(request, timeout=30):
                    if response.event.HasField("result"):
                        results.add(response.event.run_id)

        await asyncio.gather(*(client(n) for n in range(CLIENTS_PER_SERVER)))


async def test_two_processes_sharing_the_file_build_one_chain(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    results: set[str] = set()
    with serve(tmp_path / "a", "--audit-store", f"sqlite:///{db}") as first, \
            serve(tmp_path / "b", "--audit-store", f"sqlite:///{db}") as second:
        await asyncio.gather(_load(first.target, "a", results),
                             _load(second.target, "b", results))

    store = open_store(f"sqlite:///{db}")
    await store.open()
    try:
        records = [r async for r in store.scan()]
        # Each server made its own key in its own state folder: the trail names both.
        keys = [load_key(default_key_path(tmp_path / name)) for name in ("a", "b")]
        report = await verify(store.scan(), keys)
    finally:
        await store.aclose()
    executed = {r.run_id for r in records if r.method.endswith("/Execute")}
    assert len(results) == 2 * CLIENTS_PER_SERVER * CALLS_PER_CLIENT
    assert results <= executed
    assert report.intact and report.checked == len(records)
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
