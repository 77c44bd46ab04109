"""Sessions from the Go client in clients/go/: create, call in (a python variable kept
across calls), list, close; a call in a closed or unknown session is refused."""

from __future__ import annotations

import json

from tests.client_builds import json_events, run_go


async def test_go_runs_calls_in_a_session(make_server, go_cli: str) -> None:
    server = await make_server()
    target = ("-target", f"127.0.0.1:{server.port}")
    code, out, err = await run_go(go_cli, *target, "session", "create", "python")
    assert code == 0, err
    session_id = out.strip()
    assert session_id.startswith("ses_")
    code, _, err = await run_go(go_cli, *target, "call", "-session", session_id, "python",
                                '{"code": "n = 6"}')
    assert code == 0, err
    code, out, err = await run_go(go_cli, *target, "-json", "call", "-session", session_id,
                                  "python", '{"code": "n * 7"}')
    assert code == 0, err
    assert json_events(out)[-1].result.structured_output.number_value == 42
    # Without the session the variable is not there: a fresh sandbox per call.
    code, out, _ = await run_go(go_cli, *target, "-json", "call", "python", '{"code": "n"}')
    assert code == 1 and "NameError" in out

    code, out, _ = await run_go(go_cli, *target, "session", "list")
    assert out.split()[:4] == [session_id, "python", "idle", "2"]
    code, out, _ = await run_go(go_cli, *target, "-json", "session", "list")
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(s["session_id"], s["calls"]) for s in listed] == [(session_id, "2")]

    code, _, err = await run_go(go_cli, *target, "session", "close", session_id)
    assert (code, err) == (0, "closed\n")
    code, _, err = await run_go(go_cli, *target, "call", "-session", session_id, "python",
                                '{"code": "n"}')
    assert code == 1 and "[SESSION_NOT_FOUND]" in err
    code, _, err = await run_go(go_cli, *target, "session", "close", session_id)
    assert code == 1 and "[SESSION_NOT_FOUND]" in err


async def test_go_session_refusals_and_the_server_keeps_serving(make_server,
                                                                go_cli: str) -> None:
    server = await make_server()
    target = ("-target", f"127.0.0.1:{server.port}")
    code, _, err = await run_go(go_cli, *target, "session", "create", "cobol")
    assert code == 1 and err.startswith("INVALID_ARGUMENT: "), err
    for hostile in ("../../etc/passwd", "ses_" + "x" * 5000, "ses_\u202e"):
        code, _, err = await run_go(go_cli, *target, "call", "-session", hostile, "python",
                                    '{"code": "1"}')
        assert code == 1 and err.split(":")[0] in ("INVALID_ARGUMENT", "NOT_FOUND"), err
    code, _, err = await run_go(go_cli, *target, "session", "frobnicate")
    assert code == 2 and err.startswith("usage:")
    code, out, err = await run_go(go_cli, *target, "session", "create", "shell")
    assert code == 0 and out.startswith("ses_"), err
