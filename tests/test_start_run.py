"""StartRun through a real server: the run id at once, then WatchRun; an idempotency key
answers the run that holds it; refusals are Execute's."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import phases
from tests.runs_support import HeaderPrincipal, as_principal, collect, key, run_registry

ALICE = as_principal("alice")
BOB = as_principal("bob")


@pytest.fixture
async def stub(make_server) -> tool_service_pb2_grpc.ToolServiceStub:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield tool_service_pb2_grpc.ToolServiceStub(channel)
    await channel.close()


def start_request(tool_name: str, arguments: dict, **fields) -> tool_service_pb2.StartRunRequest:
    return tool_service_pb2.StartRunRequest(tool_name=tool_name,
                                            arguments_json=json.dumps(arguments), **fields)


async def test_start_run_answers_at_once_and_watch_run_follows(stub, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    started = await stub.StartRun(start_request(
        "tally", {"path": str(tmp_path / "tally"), "deltas": 2, "gate": str(gate)}),
        metadata=ALICE)
    # The run is still going (it waits for the gate): StartRun did not wait for it.
    watch = stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=started.run_id),
                          metadata=ALICE)
    first = await watch.read()
    assert first.event.run_id == started.run_id and first.event.seq == 1
    gate.write_text("")
    events = [first.event, *await collect(watch)]

    assert not started.attached
    assert phases(events)[-1] == "RESULT OK"
    assert events[-1].result.output == "tallied 2"
    assert (tmp_path / "tally").read_text().splitlines() == [started.run_id]


async def test_the_same_idempotency_key_answers_the_run_that_holds_it(stub, tmp_path) -> None:
    request = start_request("tally", {"path": str(tmp_path / "tally"), "deltas": 0},
                            idempotency_key=key())
    first = await stub.StartRun(request, metadata=ALICE)
    second = await stub.StartRun(request, metadata=ALICE)

    assert (second.run_id, second.attached) == (first.run_id, True)
    events = await collect(stub.WatchRun(
        tool_service_pb2.WatchRunRequest(run_id=first.run_id), metadata=ALICE))
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert (tmp_path / "tally").read_text().splitlines() == [first.run_id]


async def test_start_run_refuses_like_execute_and_the_run_is_not_anyone_elses(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await stub.StartRun(start_request("no_such_tool", {}), metadata=ALICE)
    with pytest.raises(grpc.aio.AioRpcError) as bad_args:
        await stub.StartRun(start_request("count", {"to": "many"}), metadata=ALICE)
    started = await stub.StartRun(start_request("count", {"to": 2}), metadata=ALICE)
    with pytest.raises(grpc.aio.AioRpcError) as other:
        await collect(stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=started.run_id),
                                    metadata=BOB))

    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert bad_args.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert other.value.code() == grpc.StatusCode.NOT_FOUND
