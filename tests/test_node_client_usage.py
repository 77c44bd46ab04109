"""The receipt (Result.usage) from the Node.js client in clients/node/: in its events, and
on the ``usage:`` line its CLI prints above the outcome, as ``stargrpc call`` does."""

from __future__ import annotations

import json

from stargrpc.server.grpc_server import StargrpcServer
from tests.client_builds import run_node


async def test_node_shows_the_receipt_of_a_run(server: StargrpcServer,
                                                node_cli: list[str]) -> None:
    target = f"127.0.0.1:{server.port}"

    code, out, _ = await run_node(node_cli, "call", "echo", '{"text": "hi"}', "--target", target)
    lines = out.splitlines()
    code_json, out_json, _ = await run_node(node_cli, "call", "echo", '{"text": "hi"}', "--json",
                                         "--target", target)
    usage = json.loads(out_json.splitlines()[-1])["result"]["usage"]

    assert code == code_json == 0
    assert lines[-2].startswith("usage: wall ") and lines[-1] == "= OK"
    # A run of under 10 ms (an echo, nearly always) reads in ms, as stargrpc call shows it
    assert not lines[-2].startswith("usage: wall 0.00s"), lines[-2]
    assert "cpu" not in lines[-2]  # an in-process tool's CPU is not measured
    assert usage["wall_seconds"] > 0
    assert usage["queued_seconds"] == 0 and usage["child_runs"] == 0
    assert "cpu_user_seconds" not in usage and "peak_rss_bytes" not in usage
