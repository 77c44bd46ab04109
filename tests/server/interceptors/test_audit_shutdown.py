"""SIGTERM while the audit store keeps every write waiting (another process holds the
SQLite trail's lock): runs that have ended still hold their Result for the record's commit.
The draining server sends those Results before its transport stops, and the records the
store never took are logged in full as the writer closes — not counted and dropped."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
from pathlib import Path

import grpc

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.procs import serve

CALLS = 4


async def _rest(stream: grpc.aio.UnaryStreamCall) -> list[tool_service_pb2.ExecuteResponse]:
    responses = []
    while (response := await stream.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def test_results_held_for_their_commit_go_out_during_the_drain(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    with serve(tmp_path / "state", "--audit-store", f"sqlite:///{db}",
               STARGRPC_AUDIT_COMMIT_TIMEOUT_SECONDS="4",
               STARGRPC_AUDIT_CLOSE_TIMEOUT_SECONDS="0.5") as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            first = [r async for r in stub.Execute(tool_service_pb2.ExecuteRequest(
                tool_name="echo", arguments_json='{"text": "first"}'), timeout=30)]
            assert first[-1].event.result.outcome == events_pb2.OUTCOME_OK
            holder = sqlite3.connect(db, isolation_level=None, timeout=0)
            holder.execute("BEGIN EXCLUSIVE")  # every write of the server now waits
            try:
                streams = [stub.Execute(tool_service_pb2.ExecuteRequest(
                    tool_name="echo", arguments_json=json.dumps({"text": f"held {i}"})),
                    timeout=30) for i in range(CALLS)]
                # Each run's first event: its run is under way (an echo ends at once, and
                # its Result then waits for the commit the lock keeps from happening).
                started = [(await stream.read()).event.run_id for stream in streams]
                server.signal(signal.SIGTERM)
                ends = [await _rest(stream) for stream in streams]
                # Each caller got its Result (after audit_commit_timeout_seconds at most),
                # not the transport's UNAVAILABLE.
                assert [end[-1].event.result.output for end in ends] == [
                    f"held {i}" for i in range(CALLS)]
                assert await asyncio.to_thread(server.proc.wait, 30) == 0
                server.wait_for(lambda line: line.get("event") == "stopped", 10)
            finally:
                holder.rollback()
                holder.close()
    # The store never took them: the log holds each record in full.
    lines = [line for line in server.lines if line.get("event") == "audit_record_not_stored"]
    lost = {str(line["record"]["run_id"]): line["record"]  # type: ignore[index]
            for line in lines}
    assert set(started) <= set(lost)
    assert all(lost[run_id]["tool"] == "echo" for run_id in started)
    # The batch whose write the close cut off may be in the trail after all: said so.
    assert any("look for its id" in str(line["reason"]) for line in lines)
