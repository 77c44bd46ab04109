"""Idempotency keys through a real server: attach while running, replay after, refuse reuse
for something else, keys per principal, and 50 simultaneous Executes running once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from stargrpc import ToolContext, tool
from stargrpc.registry import NoArguments, Registry, spec_of
from stargrpc.runs.idempotency import fingerprint
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import status_details
from tests.runs_support import (
    HeaderPrincipal,
    as_principal,
    collect,
    execute_request,
    key,
    run_registry,
    stripped,
)

ALICE = as_principal("alice")
BOB = as_principal("bob")


@pytest.fixture
async def stub(make_server) -> tool_service_pb2_grpc.ToolServiceStub:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield tool_service_pb2_grpc.ToolServiceStub(channel)
    await channel.close()


def runs_in(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def test_a_repeat_after_the_run_replays_it_without_running_again(stub, tmp_path: Path
                                                                       ) -> None:
    tally = tmp_path / "tally"
    request = execute_request("tally", {"path": str(tally)}, idempotency_key=key())

    first = await collect(stub.Execute(request, metadata=ALICE))
    second = await collect(stub.Execute(request, metadata=ALICE))

    assert stripped(second) == stripped(first)
    assert second[-1].result.outcome == events_pb2.OUTCOME_OK
    assert runs_in(tally) == [first[0].run_id]


async def test_a_repeat_while_running_attaches_from_seq_1(stub, tmp_path: Path) -> None:
    gate, tally = tmp_path / "gate", tmp_path / "tally"
    request = execute_request("tally", {"path": str(tally), "gate": str(gate)},
                              idempotency_key=key())
    first = stub.Execute(request, metadata=ALICE)
    head = [(await first.read()).event for _ in range(4)]
    second = stub.Execute(request, metadata=ALICE)
    attached_head = [(await second.read()).event for _ in range(4)]
    gate.touch()

    first_all = head + await collect(first)
    second_all = attached_head + await collect(second)

    assert attached_head[0].seq == 1
    assert stripped(second_all) == stripped(first_all)
    assert len(runs_in(tally)) == 1


async def test_the_same_key_for_other_arguments_is_refused(stub, tmp_path: Path) -> None:
    same = key()
    await collect(stub.Execute(execute_request("echo", {"text": "a"}, idempotency_key=same),
                               metadata=ALICE))

    for request in (execute_request("echo", {"text": "b"}, idempotency_key=same),
                    execute_request("count", {"to": 1}, idempotency_key=same)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(stub.Execute(request, metadata=ALICE))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert status_details(caught.value)[0].reason == "IDEMPOTENCY_KEY_REUSED"


async def test_keys_never_cross_principals(stub, tmp_path: Path) -> None:
    tally = tmp_path / "tally"
    request = execute_request("tally", {"path": str(tally)}, idempotency_key=key())

    alice = await collect(stub.Execute(request, metadata=ALICE))
    bob = await collect(stub.Execute(request, metadata=BOB))

    assert alice[0].run_id != bob[0].run_id
    assert len(runs_in(tally)) == 2


async def test_fifty_simultaneous_executes_with_one_key_run_once_and_see_one_stream(
        stub, tmp_path: Path) -> None:
    tally = tmp_path / "tally"
    request = execute_request("tally", {"path": str(tally), "deltas": 20},
                              idempotency_key=key())

    streams = await asyncio.gather(
        *(collect(stub.Execute(request, metadata=ALICE)) for _ in range(50)))

    assert len(runs_in(tally)) == 1
    assert all(stripped(s) == stripped(streams[0]) for s in streams)
    assert streams[0][-1].result.output == "tallied 20"


def test_fingerprint_ignores_key_order_but_not_values() -> None:
    assert fingerprint("t", {"a": 1, "b": [1, 2]}) == fingerprint("t", {"b": [1, 2], "a": 1})
    assert fingerprint("t", {"a": 1}) != fingerprint("t", {"a": 2})
    assert fingerprint("t", {"a": 1}) != fingerprint("u", {"a": 1})


@tool()
async def whoami(ctx: ToolContext, args: NoArguments) -> str:
    """Names the end user the call is for (or its caller)."""
    return ctx.principal.acting_for or ctx.principal.id


async def test_a_key_never_replays_the_run_of_another_end_user(make_server) -> None:
    # A gateway acting for its end users: a run's output may be the end user's (tools see
    # ctx.principal.acting_for); the same key and arguments for another end user replayed
    # the first one's Result to the second.
    server = await make_server(registry=Registry([spec_of(whoami)]),  # type: ignore[misc]
                               interceptors=[HeaderPrincipal()])
    gateway = as_principal("gateway", "delegate")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        same = key()

        def request(end_user: str) -> tool_service_pb2.ExecuteRequest:
            made = execute_request("whoami", idempotency_key=same)
            made.context.end_user = end_user
            return made

        alice = await collect(stub.Execute(request("alice"), metadata=gateway))
        alice_again = await collect(stub.Execute(request("alice"), metadata=gateway))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub.Execute(request("bob"), metadata=gateway))

    assert alice[-1].result.output == "alice"
    assert stripped(alice_again) == stripped(alice)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert any(getattr(d, "reason", "") == "IDEMPOTENCY_KEY_REUSED"
               for d in status_details(refused.value))
