"""``stargrpc runs --tree`` and ``stargrpc audit query --root`` as a user runs them: child
processes against a real server that ran a call tree of depth 2 with fan-out."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import grpc

from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import eventually, run_tool
from tests.tree_tools import tree_registry

TIMEOUT = 60


async def _stargrpc(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_runs_tree_prints_the_tree_and_audit_query_root_its_records(
        make_server: Any, tmp_path: Any) -> None:
    server = await make_server(registry=tree_registry())
    target = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "tree_node", {"levels": 2, "fan_out": 2})
        other = await run_tool(stub, "echo", {"text": "not in the tree"})
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    root = events[0].run_id

    code, out, err = await _stargrpc("runs", "--target", target, "--tree", root)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 7 and lines[0].startswith(root)
    indents = sorted(len(line) - len(line.lstrip()) for line in lines)
    assert indents == [0, 2, 2, 4, 4, 4, 4]
    # Each grandchild comes right after its parent's line or a sibling's.
    for at, line in enumerate(lines):
        if line.startswith("    "):
            assert lines[at - 1].startswith(("  ", "    "))
    assert other[0].run_id not in out

    code, _, err = await _stargrpc("runs", "--target", target, "--tree", "0" * 32)
    assert code == 1 and "no call tree" in err

    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await eventually(lambda: audit.open_calls == 0, what="every record handed over")
    await audit.writer.flush()
    store = f"sqlite:///{tmp_path / 'state' / 'audit.db'}"
    code, out, err = await _stargrpc("audit", "query", "--store", store, "--root", root,
                                     "--json")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 7
    assert {r["root_run_id"] for r in records} == {root}
    assert sorted(r["method"].rsplit("/", 1)[1] for r in records) == ["Call"] * 6 + ["Execute"]
    code, out, _ = await _stargrpc("audit", "query", "--store", store, "--root", root)
    assert code == 0 and out.count(f"parent={root}") == 2
