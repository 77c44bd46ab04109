"""Run state from the Go client in clients/go/ (``stargrpc-go state get|set|delete|list``)
against a real server with authentication on: an admin reads what a tool kept, writes,
deletes and pages through a scope; anyone else is refused; bad input is refused with its
reason and the server keeps serving."""

from __future__ import annotations

import json

from stargrpc.client import AsyncClient
from tests.client_builds import run_go
from tests.helpers import key_channel
from tests.state_tools import state_op_run_id, state_registry


async def test_go_reads_writes_deletes_and_lists_run_state(make_auth_server,
                                                           go_cli: str) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",))
    admin = ("-target", auth.target, "-api-key", auth.key)
    run_id = await state_op_run_id(auth.target, auth.key, scope="tree", op="set", key="plan",
                                   value=["a", "b"])

    code, out, err = await run_go(go_cli, *admin, "state", "get", "-scope", "tree", "-run",
                                  run_id, "plan")
    assert (code, out) == (0, '["a","b"]\n'), err
    code, out, err = await run_go(go_cli, *admin, "state", "get", "-scope", "run", "-run",
                                  run_id, "plan")
    assert (code, out, err) == (3, "", "plan: absent\n")

    # A large integer keeps every digit both ways; the Python client reads what Go wrote.
    code, _, err = await run_go(go_cli, *admin, "state", "set", "-scope", "global", "-ttl",
                                "3600", "big", str(2**60 + 1))
    assert code == 0, err
    code, out, _ = await run_go(go_cli, *admin, "state", "get", "-scope", "global", "big")
    assert out == f"{2**60 + 1}\n"
    python = AsyncClient(key_channel(auth.target, auth.key), own_channel=True)
    assert await python.get_state("global", "big") == 2**60 + 1

    for index in range(3):
        code, _, err = await run_go(go_cli, *admin, "state", "set", "-scope", "principal",
                                    "-principal", "someone", f"k{index}", f'"v{index}"')
        assert code == 0, err
    code, out, err = await run_go(go_cli, *admin, "state", "list", "-scope", "principal",
                                  "-principal", "someone", "-limit", "2", "-values")
    assert (code, out, err) == (0, 'k0\t"v0"\nk1\t"v1"\n', "more: -after k1\n")
    code, out, err = await run_go(go_cli, *admin, "state", "list", "-scope", "principal",
                                  "-principal", "someone", "-after", "k1")
    assert (code, out, err) == (0, "k2\n", "")

    code, _, _ = await run_go(go_cli, *admin, "state", "delete", "-scope", "global", "big")
    assert code == 0
    code, _, err = await run_go(go_cli, *admin, "state", "delete", "-scope", "global", "big")
    assert (code, err) == (3, "big: absent\n")
    assert await python.get_state("global", "big", "gone") == "gone"
    await python.close()


async def test_go_state_refusals_name_their_reason_and_the_server_keeps_serving(
        make_auth_server, go_cli: str) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",),
                                  state_max_value_bytes=64)
    admin = ("-target", auth.target, "-api-key", auth.key)
    bob = ("-target", auth.target, "-api-key", auth.add_key("bob", "tools"))

    code, _, err = await run_go(go_cli, *bob, "state", "get", "-scope", "global", "k")
    assert code == 1 and err.startswith("PERMISSION_DENIED: "), err
    # Missing and malformed input the command line catches itself (exit 2).
    for args in (("get", "-scope", "run", "k"), ("get", "-scope", "planet", "k"),
                 ("get", "-scope", "principal", "k"), ("set", "-scope", "global", "k", "{no"),
                 ("set", "-scope", "global", "k"), ("list", "-scope", "global", "-limit", "0"),
                 ("frobnicate", "-scope", "global")):
        code, _, _ = await run_go(go_cli, *admin, "state", *args)
        assert code == 2, args
    # What the server refuses: a hostile key, an oversized value, a hostile run id.
    refusals = [
        (("get", "-scope", "global", "bad\nkey"), "STATE_BAD_KEY"),
        (("set", "-scope", "global", "k", json.dumps("x" * 500)), "STATE_VALUE_TOO_LARGE"),
        (("get", "-scope", "run", "-run", "../../etc", "k"), "STATE_BAD_SCOPE"),
        (("get", "-scope", "global", "k" * 5000), "STATE_BAD_KEY"),
    ]
    for args, reason in refusals:
        code, _, err = await run_go(go_cli, *admin, "state", *args)
        assert code == 1 and err.startswith("INVALID_ARGUMENT: ") and f"[{reason}]" in err, \
            (args, err)
    code, _, err = await run_go(go_cli, *admin, "state", "set", "-scope", "global", "k", "1")
    assert code == 0, err
    code, out, _ = await run_go(go_cli, *admin, "state", "get", "-scope", "global", "k")
    assert (code, out) == (0, "1\n")
