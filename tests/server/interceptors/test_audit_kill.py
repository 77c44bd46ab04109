"""Nothing a client saw is missing from the audit trail, even when the server is killed
with SIGKILL in the middle of a load: a Result is only sent once its record is committed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import grpc

from stargrpc.audit.chain import verify
from stargrpc.audit.key import default_key_path, load_key
from stargrpc.audit.store import open_store
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.procs import serve

CLIENTS = 8
KILL_AFTER_RESULTS = 60
MAX_CALLS_PER_CLIENT = 300  # bounds the load loop in count ...
MAX_SECONDS = 60.0  # ... and in time


async def test_every_result_a_client_saw_survives_sigkill(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    seen: dict[str, str] = {}  # run id -> outcome, for every Result that reached a client
    enough = asyncio.Event()

    with serve(tmp_path / "state", "--audit-store", f"sqlite:///{db}") as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            stop_at = time.monotonic() + MAX_SECONDS

            async def client(number: int) -> None:
                for i in range(MAX_CALLS_PER_CLIENT):
                    if time.monotonic() > stop_at:
                        return
                    request = tool_service_pb2.ExecuteRequest(
                        tool_name="echo", arguments_json=json.dumps({"text": f"{number}-{i}"}))
                    try:
                        async for response in stub.Execute(request, timeout=30):
                            if response.event.HasField("result"):
                                seen[response.event.run_id] = "ok"
                    except grpc.aio.AioRpcError:
                        return  # the server is gone
                    if len(seen) >= KILL_AFTER_RESULTS:
                        enough.set()

            clients = [asyncio.create_task(client(n)) for n in range(CLIENTS)]
            await asyncio.wait_for(enough.wait(), MAX_SECONDS)
            os.killpg(server.proc.pid, signal.SIGKILL)  # mid-load, calls in flight
            await asyncio.gather(*clients)
        assert server.proc.wait(10) == -signal.SIGKILL

    store = open_store(f"sqlite:///{db}")
    await store.open()
    try:
        records = {r.run_id: r async for r in store.scan()}
        report = await verify(store.scan(), [load_key(default_key_path(tmp_path / "state"))])
    finally:
        await store.aclose()
    missing = set(seen) - set(records)
    assert not missing, f"{len(missing)} of {len(seen)} results have no audit record"
    assert all(records[run_id].outcome == "ok" for run_id in seen)
    assert report.intact
