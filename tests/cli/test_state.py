"""``stargrpc state get/set/delete/list`` as an operator runs them: a child process against
a real server with authentication on; an admin key works, any other is refused."""

from __future__ import annotations

import asyncio
import json
import os
import sys

TIMEOUT = 60


async def _stargrpc(*args: str, key: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", "state", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "STARGRPC_API_KEY": key})
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_an_operator_sets_gets_lists_and_deletes(make_auth_server) -> None:
    auth = await make_auth_server(roles=("admin",))
    target = ("--target", auth.target)
    run = ("--scope", "run", "--run", "0123abcd", *target)

    assert await _stargrpc("set", *run, "plan", '{"step": 2, "big": 12345678901234567890}',
                           key=auth.key) == (0, "", "")
    assert await _stargrpc("set", *run, "note", '"hello"', "--ttl", "60",
                           key=auth.key) == (0, "", "")
    code, out, _ = await _stargrpc("get", *run, "plan", key=auth.key)
    assert (code, json.loads(out)) == (0, {"step": 2, "big": 12345678901234567890})
    assert (await _stargrpc("list", *run, key=auth.key))[:2] == (0, "note\nplan\n")
    code, out, err = await _stargrpc("list", *run, "--values", "--limit", "1", key=auth.key)
    assert (code, out, err) == (0, 'note\t"hello"\n', "more: --after note\n")
    assert (await _stargrpc("delete", *run, "note", key=auth.key))[0] == 0
    assert (await _stargrpc("delete", *run, "note", key=auth.key))[0] == 3
    assert (await _stargrpc("get", *run, "note", key=auth.key))[0] == 3
    # The tree of another run holds nothing of this run's.
    code, out, _ = await _stargrpc("list", "--scope", "tree", "--run", "0123abcd", *target,
                                   key=auth.key)
    assert (code, out) == (0, "")


async def test_refusals_exit_with_their_reason(make_auth_server) -> None:
    auth = await make_auth_server(roles=("admin",))
    viewer = auth.add_key("viewer", "tools")
    target = ("--target", auth.target)

    code, _, err = await _stargrpc("get", "--scope", "global", *target, "k", key=viewer)
    assert code == 1 and "PERMISSION_DENIED" in err
    code, _, err = await _stargrpc("set", "--scope", "global", *target, "a/b", "1",
                                   key=auth.key)
    assert code == 1 and "key:" in err and "'/'" in err
    code, _, err = await _stargrpc("set", "--scope", "global", *target, "k", "not json",
                                   key=auth.key)
    assert code == 2 and "not JSON" in err
    code, _, err = await _stargrpc("get", "--scope", "run", *target, "k", key=auth.key)
    assert code == 2 and "--run" in err
