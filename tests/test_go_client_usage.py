"""The receipt (Result.usage) from the Go client in clients/go/: its generated types carry
it, and its CLI prints it on a ``usage:`` line above the outcome, as ``stargrpc call`` does."""

from __future__ import annotations

from tests.client_builds import json_events, run_go
from tests.conftest import AuthServerFactory


async def test_go_shows_the_receipt_of_a_run(make_auth_server: AuthServerFactory,
                                              go_cli: str) -> None:
    auth = await make_auth_server()
    common = ("-target", auth.target, "-api-key", auth.key)

    code, out, _ = await run_go(go_cli, *common, "call", "echo", '{"text": "hi"}')
    code_json, out_json, _ = await run_go(go_cli, *common, "-json", "call", "echo",
                                       '{"text": "hi"}')
    result = json_events(out_json)[-1].result
    lines = out.splitlines()

    assert code == code_json == 0
    assert lines[-2].startswith("usage: wall ") and lines[-1] == "= OK"
    # A run of under 10 ms (an echo, nearly always) reads in ms, as stargrpc call shows it
    assert not lines[-2].startswith("usage: wall 0.00s"), lines[-2]
    assert "cpu" not in lines[-2]  # an in-process tool's CPU is not measured
    assert result.usage.wall_seconds > 0
    assert result.usage.HasField("child_runs") and not result.usage.HasField("cpu_user_seconds")
