"""The receipt (Result.usage) from the Go client in clients/go/: its generated types carry
it, and its CLI prints it on a ``usage:`` line above the outcome, as ``stargrpc call`` does."""

from __future__ import annotations

from tests.conftest import AuthServerFactory
from tests.test_go_client import _events, _go, go_cli  # noqa: F401


async def test_go_shows_the_receipt_of_a_run(make_auth_server: AuthServerFactory,
                                              go_cli: str) -> None:  # noqa: F811
    auth = await make_auth_server()
    common = ("-target", auth.target, "-api-key", auth.key)

    code, out, _ = await _go(go_cli, *common, "call", "echo", '{"text": "hi"}')
    code_json, out_json, _ = await _go(go_cli, *common, "-json", "call", "echo",
                                       '{"text": "hi"}')
    result = _events(out_json)[-1].result
    lines = out.splitlines()

    assert code == code_json == 0
    assert lines[-2].startswith("usage: wall ") and lines[-1] == "= OK"
    assert "cpu" not in lines[-2]  # an in-process tool's CPU is not measured
    assert result.usage.wall_seconds > 0
    assert result.usage.HasField("child_runs") and not result.usage.HasField("cpu_user_seconds")
