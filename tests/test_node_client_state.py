"""Run state from the Node.js client in clients/node/ (``cli.js state get|set|delete|list``)
against a real server with authentication on: an admin reads what a tool kept, writes,
deletes and pages through a scope; anyone else is refused; bad input is refused with its
reason and the server keeps serving."""

from __future__ import annotations

import json

from stargrpc.client import AsyncClient
from tests.client_builds import run_node
from tests.helpers import key_channel
from tests.state_tools import state_op_run_id, state_registry


async def test_node_reads_writes_deletes_and_lists_run_state(make_auth_server,
                                                             node_cli: list[str]) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",))
    admin = ("--target", auth.target, "--api-key", auth.key)
    run_id = await state_op_run_id(auth.target, auth.key, scope="run", op="set",
                                   key="progress", value={"done": 3})

    code, out, err = await run_node(node_cli, "state", "get", "--scope", "run", "--run",
                                    run_id, "progress", *admin)
    assert (code, out) == (0, '{"done":3}\n'), err
    code, out, err = await run_node(node_cli, "state", "get", "--scope", "tree", "--run",
                                    run_id, "progress", *admin)
    assert (code, out, err) == (3, "", "progress: absent\n")

    # A large integer keeps every digit both ways; the Python client reads what Node wrote.
    code, _, err = await run_node(node_cli, "state", "set", "--scope", "global", "big",
                                  str(2**60 + 1), "--ttl", "3600", *admin)
    assert code == 0, err
    code, out, _ = await run_node(node_cli, "state", "get", "--scope", "global", "big", *admin)
    assert out == f"{2**60 + 1}\n"
    python = AsyncClient(key_channel(auth.target, auth.key), own_channel=True)
    assert await python.get_state("global", "big") == 2**60 + 1

    for index in range(3):
        code, _, err = await run_node(node_cli, "state", "set", "--scope", "principal",
                                      "--principal", "someone", f"k{index}", f'"v{index}"',
                                      *admin)
        assert code == 0, err
    code, out, err = await run_node(node_cli, "state", "list", "--scope", "principal",
                                    "--principal", "someone", "--limit", "2", "--values",
                                    *admin)
    assert (code, out, err) == (0, 'k0\t"v0"\nk1\t"v1"\n', "more: --after k1\n")
    code, out, err = await run_node(node_cli, "state", "list", "--scope", "principal",
                                    "--principal", "someone", "--after", "k1", *admin)
    assert (code, out, err) == (0, "k2\n", "")
    assert (await python.list_state("principal", principal="someone")).next_after_key == ""

    code, _, _ = await run_node(node_cli, "state", "delete", "--scope", "global", "big",
                                *admin)
    assert code == 0
    code, _, err = await run_node(node_cli, "state", "delete", "--scope", "global", "big",
                                  *admin)
    assert (code, err) == (3, "big: absent\n")
    assert await python.get_state("global", "big", "gone") == "gone"
    await python.close()


async def test_node_state_refusals_name_their_reason_and_the_server_keeps_serving(
        make_auth_server, node_cli: list[str]) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",),
                                  state_max_value_bytes=64)
    admin = ("--target", auth.target, "--api-key", auth.key)
    bob = ("--target", auth.target, "--api-key", auth.add_key("bob", "tools"))

    code, _, err = await run_node(node_cli, "state", "get", "--scope", "global", "k", *bob)
    assert code == 1 and "PERMISSION_DENIED" in err
    # Missing and malformed input the command line catches itself (usage, exit 2).
    for args in (("get", "--scope", "run", "k"), ("get", "--scope", "planet", "k"),
                 ("get", "--scope", "principal", "k"), ("set", "--scope", "global", "k", "{no"),
                 ("set", "--scope", "global", "k"), ("list", "--scope", "global", "--limit", "0")):
        code, _, err = await run_node(node_cli, "state", *args, *admin)
        assert code == 2 and err.startswith("error: "), (args, err)
    # What the server refuses: a hostile key, an oversized value, a hostile run id.
    refusals = [
        (("get", "--scope", "global", "bad\nkey"), "STATE_BAD_KEY"),
        (("set", "--scope", "global", "k", json.dumps("x" * 500)), "STATE_VALUE_TOO_LARGE"),
        (("get", "--scope", "run", "--run", "../../etc", "k"), "STATE_BAD_SCOPE"),
        (("get", "--scope", "global", "k" * 5000), "STATE_BAD_KEY"),
    ]
    for args, reason in refusals:
        code, _, err = await run_node(node_cli, "state", *args, *admin)
        assert code == 1 and "INVALID_ARGUMENT" in err and f"[{reason}]" in err, (args, err)
    code, _, err = await run_node(node_cli, "state", "set", "--scope", "global", "k", "1",
                                  *admin)
    assert code == 0, err
    code, out, _ = await run_node(node_cli, "state", "get", "--scope", "global", "k", *admin)
    assert (code, out) == (0, "1\n")
