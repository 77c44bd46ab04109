"""Sessions from the Node.js client in clients/node/: create, call in, list, close."""

from __future__ import annotations

import json

from tests.client_builds import run_node


async def test_node_runs_calls_in_a_session(make_server, node_cli: list[str]) -> None:
    server = await make_server()
    target = ("--target", f"127.0.0.1:{server.port}")
    code, out, err = await run_node(node_cli, "session", "create", "python", *target)
    assert code == 0, err
    session_id = out.strip()
    code, _, err = await run_node(node_cli, "call", "python", '{"code": "n = 6"}',
                                  "--session", session_id, *target)
    assert code == 0, err
    code, out, err = await run_node(node_cli, "call", "python", '{"code": "n * 7"}',
                                    "--session", session_id, "--json", *target)
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["result"]["structured_output"] == 42
    code, out, _ = await run_node(node_cli, "session", "list", *target)
    assert out.split()[:4] == [session_id, "python", "idle", "2"]
    code, _, err = await run_node(node_cli, "session", "close", session_id, *target)
    assert code == 0 and "closed" in err
    code, _, err = await run_node(node_cli, "call", "python", '{"code": "n"}',
                                  "--session", session_id, *target)
    assert code != 0 and "SESSION_NOT_FOUND" in err
