"""Approval from the shell and the Python SDK: ``stargrpc runs --state awaiting_approval``
shows what waits, ``stargrpc approve`` / ``stargrpc deny`` decide (a refusal exits with
the RPC error status and its reason), and ``AsyncClient.approve`` / ``Client.approve`` do
the same in code."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from stargrpc.client import AsyncClient, CallError, Client
from stargrpc.v1 import events_pb2
from tests.approval.approval_helpers import (
    BODIES_RUN,
    execute_request,
    read_until_approval,
    rest_of,
)
from tests.client_builds import run_go, run_node

TIMEOUT = 60


async def _stargrpc(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ})
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_approve_and_deny_from_the_shell(auth, people) -> None:
    bob = ["--target", auth.target, "--api-key", auth.add_key("dave", "approver")]
    call = people.alice.Execute(execute_request("deploy", {"service": "shell"}))
    head, approval = await read_until_approval(call)
    run_id = head[0].run_id

    code, out, _ = await _stargrpc("runs", "--state", "awaiting_approval", *bob)
    assert code == 0
    [line] = [line for line in out.splitlines() if line.startswith(run_id)]
    assert "awaiting" in line and approval.approval_id in line and "shell" in line

    code, _, err = await _stargrpc("approve", run_id, "--approval-id", "forged", *bob)
    assert code != 0 and "APPROVAL_ID_MISMATCH" in err
    code, _, err = await _stargrpc("approve", run_id, "--approval-id", approval.approval_id,
                                   "--reason", "from the shell",
                                   "--arguments-digest", approval.arguments_digest, *bob)
    assert (code, err.strip()) == (
        0, f"approved run {run_id} (arguments sha256 {approval.arguments_digest})")
    events = await rest_of(call)
    assert events[-1].result.output == "deployed shell to staging"

    call = people.alice.Execute(execute_request("deploy", {"service": "other"}))
    head, approval = await read_until_approval(call)
    code, _, _ = await _stargrpc("deny", head[0].run_id, "--approval-id",
                                 approval.approval_id, "--reason", "no", *bob)
    assert code == 0
    result = (await rest_of(call))[-1].result
    assert (result.error.code, result.error.message) == ("APPROVAL_DENIED", "denied by dave: no")
    assert head[0].run_id not in BODIES_RUN


async def test_approve_with_the_python_clients(auth, people) -> None:
    key = auth.add_key("erin", "approver")
    call = people.alice.Execute(execute_request("deploy", {"service": "sdk"}))
    head, approval = await read_until_approval(call)
    async with AsyncClient.connect(auth.target, api_key=key) as client:
        page = await client.list_runs(state="awaiting_approval")
        assert [run.approval.approval_id for run in page.runs
                if run.run_id == head[0].run_id] == [approval.approval_id]
        with pytest.raises(CallError) as refused:
            await client.approve(head[0].run_id, approval.approval_id,
                                 arguments_digest="0" * 64)
        assert refused.value.reason == "APPROVAL_DIGEST_MISMATCH"
        reply = await client.approve(head[0].run_id, approval.approval_id, reason="sdk")
        assert reply.arguments_digest == approval.arguments_digest
    assert (await rest_of(call))[-1].result.outcome == events_pb2.OUTCOME_OK

    call = people.alice.Execute(execute_request("deploy", {"service": "sync"}))
    head, approval = await read_until_approval(call)

    def deny_blocking() -> None:
        with Client(auth.target, api_key=key) as client:
            client.approve(head[0].run_id, approval.approval_id, deny=True, reason="sync")

    await asyncio.to_thread(deny_blocking)
    assert (await rest_of(call))[-1].result.error.message == "denied by erin: sync"


async def _decide_with(command: Callable[..., Awaitable[tuple[int, str, str]]], flag: str,
                       auth: Any, people: Any, approver: str) -> None:
    """Approves one run (after a forged id is refused) and denies another with a client's
    command line: ``command(*args)`` runs it, ``flag`` is its option prefix (- or --)."""
    target = [f"{flag}target", auth.target, f"{flag}api-key", auth.add_key(approver, "approver")]
    call = people.alice.Execute(execute_request("deploy", {"service": approver}))
    head, approval = await read_until_approval(call)
    run_id = head[0].run_id

    code, _, err = await command(*target, "approve", f"{flag}approval-id", "forged", run_id)
    assert code == 1 and "PERMISSION_DENIED" in err and "APPROVAL_ID_MISMATCH" in err
    code, _, err = await command(*target, "approve", f"{flag}approval-id",
                                 approval.approval_id, f"{flag}arguments-digest",
                                 approval.arguments_digest, run_id)
    assert (code, err.strip()) == (0, f"approved run {run_id}")
    assert (await rest_of(call))[-1].result.output == f"deployed {approver} to staging"

    call = people.alice.Execute(execute_request("deploy", {"service": "other"}))
    head, approval = await read_until_approval(call)
    code, _, deny_err = await command(*target, "deny", f"{flag}approval-id", approval.approval_id,
                               f"{flag}reason", "from the client", head[0].run_id)
    assert code == 0, deny_err
    assert (await rest_of(call))[-1].result.error.message == \
        f"denied by {approver}: from the client"


async def test_approve_and_deny_with_the_node_client(auth, people, node_cli) -> None:
    await _decide_with(lambda *args: run_node(node_cli, *args), "--", auth, people, "frank")


async def test_approve_and_deny_with_the_go_client(auth, people, go_cli) -> None:
    await _decide_with(lambda *args: run_go(go_cli, *args), "-", auth, people, "grace")
