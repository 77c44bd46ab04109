"""The audit trail's disk fills up under load, then frees: the server keeps serving
meanwhile (each Result waits at most ``audit_commit_timeout_seconds`` for its record), says
so in its log, and once the disk has room again every record is written — none lost, the
chain intact.

The full disk is the server's own file size limit (RLIMIT_FSIZE, which Python turns into
EFBIG: it ignores SIGXFSZ), lowered for its process only and raised again while it runs —
what SQLite sees of a full disk (SQLITE_FULL) without filling a real one.
"""

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

#: Room for the trail's files at the start: a few dozen commits of the WAL.
FILE_SIZE_LIMIT = 256 * 1024
CLIENTS = 4
CALLS_PER_CLIENT = 40  # bounds the load in count ...
MAX_SECONDS = 60.0  # ... and in time

async def test_a_full_disk_delays_records_and_loses_none(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    seen: set[str] = set()  # every run whose Result reached a client

    with serve(tmp_path / "state", "--audit-store", f"sqlite:///{db}",
               prefix=["prlimit", f"--fsize={FILE_SIZE_LIMIT}:unlimited", "--"],
               STARGRPC_AUDIT_COMMIT_TIMEOUT_SECONDS="0.2") as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            stop_at = time.monotonic() + MAX_SECONDS

            async def client(number: int) -> None:
                for i in range(CALLS_PER_CLIENT):
                    if time.monotonic() > stop_at:
                        return
                    request = tool_service_pb2.ExecuteRequest(
                        tool_name="echo", arguments_json=json.dumps({"text": f"{number}-{i}"}))
                    async for response in stub.Execute(request, timeout=30):
                        if response.event.HasField("result"):
                            assert response.event.result.output == f"{number}-{i}"
                            seen.add(response.event.run_id)

            await asyncio.gather(*(client(n) for n in range(CLIENTS)))
            # The trail outgrew the limit long before the load ended, and the operator was
            # told; every call was served all the same.
            failed = await asyncio.to_thread(
                server.wait_for, lambda line: line.get("event") == "audit_write_failed", 10)
            assert "error" in failed
            assert len(seen) == CLIENTS * CALLS_PER_CLIENT

            # Room again: the writer's next retry (at most 5 s away) writes everything.
            raised = await asyncio.create_subprocess_exec(
                "prlimit", "--pid", str(server.proc.pid), "--fsize=unlimited")
            assert await raised.wait() == 0
            request = tool_service_pb2.ExecuteRequest(tool_name="echo",
                                                      arguments_json='{"text": "after"}')
            after = [r async for r in stub.Execute(request, timeout=30)]
            seen.add(after[-1].event.run_id)
        assert server.stop() == 0  # a clean stop writes what is still queued

    store = open_store(f"sqlite:///{db}")
    await store.open()
    try:
        records = {r.run_id: r async for r in store.scan()}
        report = await verify(store.scan(), [load_key(default_key_path(tmp_path / "state"))])
    finally:
        await store.aclose()
    missing = seen - set(records)
    assert not missing, f"{len(missing)} of {len(seen)} results have no audit record"
    assert report.intact and report.checked == len(records)
