"""The SQLite trail's disk stalls (a frozen file system, a hung network mount): every
append blocks inside SQLite. With appends on the store's thread
(``audit_sqlite_append_on_loop`` off: a deployment whose disk may stall) only the Results
wait, each at most ``audit_commit_timeout_seconds``; the server answers its other
calls meanwhile, and once the disk moves again every record is in the trail.

The stall is a function of the test's, called by a trigger on the server's own connection
before each insert: it blocks exactly where a write to a frozen disk blocks."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stargrpc.audit.sqlite import SqliteAuditStore
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import ServerFactory

CALLS = 3


def _stall_inserts(db: sqlite3.Connection, moving: threading.Event) -> None:
    """Makes each insert on ``db`` wait until ``moving`` is set (on the store's thread)."""
    db.create_function("disk_stalls", 0, lambda: moving.wait(60))
    db.execute("CREATE TEMP TRIGGER disk_stalls BEFORE INSERT ON main.audit_records "
               "BEGIN SELECT disk_stalls(); END")


async def test_a_stalled_trail_holds_results_not_the_server(make_server: ServerFactory) -> None:
    server = await make_server(audit_commit_timeout_seconds=0.5,
                               audit_sqlite_append_on_loop=False)
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    store = audit.writer.store
    assert isinstance(store, SqliteAuditStore) and not store.on_loop
    moving = threading.Event()
    await store._run(_stall_inserts, store._conn, moving)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)

            async def call(i: int) -> events_pb2.RunEvent:
                request = tool_service_pb2.ExecuteRequest(
                    tool_name="echo", arguments_json=json.dumps({"text": f"stalled {i}"}))
                return [r.event async for r in stub.Execute(request, timeout=30)][-1]

            ends = await asyncio.gather(*(call(i) for i in range(CALLS)))
            # Each Result went out after the commit timeout, the records still queued.
            assert [end.result.output for end in ends] == [f"stalled {i}" for i in range(CALLS)]
            assert audit.writer.pending >= CALLS
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            moving.set()
            await asyncio.wait_for(audit.writer.flush(), 30)
    finally:
        moving.set()
    stored = {r.run_id async for r in store.scan()}
    assert {end.run_id for end in ends} <= stored
