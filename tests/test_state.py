"""Run state (``ctx.state``) through Execute on a real server with the memory store: the API
in async and sync tools, scopes kept apart, every bad input refused with its code, global
writes only for the tools the operator names, and run state gone after its retention."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis

from stargrpc.runs.state import RunState, StateUnavailable, StateValueNotJson, encode
from stargrpc.settings import Settings
from stargrpc.stores.redis.state import RedisStateStore
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import eventually, free_port
from tests.runs_support import HeaderPrincipal
from tests.state_tools import call_state_tool as state_call
from tests.state_tools import state_registry, value_of

TOOLS = ["state_op", "state_op_sync"]


async def _state_stub(make_server: Any, **settings: Any) -> Any:
    server = await make_server(registry=state_registry(), interceptors=[HeaderPrincipal()],
                               **settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return server, tool_service_pb2_grpc.ToolServiceStub(channel)


@pytest.mark.parametrize("tool", TOOLS)
async def test_a_tool_keeps_state_across_calls_with_every_operation(make_server, tool) -> None:
    _, stub = await _state_stub(make_server)
    call = lambda **a: state_call(stub, tool, scope="principal", **a)  # noqa: E731
    assert value_of(await call(op="get", key="seen")) is None
    assert value_of(await call(op="set", key="seen", value={"urls": ["a"], "n": 1})) is None
    assert value_of(await call(op="get", key="seen")) == {"n": 1, "urls": ["a"]}
    # compare_and_set: the expected value (equal JSON, any key order) wins once.
    assert value_of(await call(op="cas", key="seen", expected={"n": 1, "urls": ["a"]},
                             value={"n": 2})) is True
    assert value_of(await call(op="cas", key="seen", expected={"n": 1, "urls": ["a"]},
                             value={"n": 3})) is False
    assert value_of(await call(op="cas", key="fresh", expected=None, value=1)) is True
    assert value_of(await call(op="cas", key="fresh", expected=None, value=2)) is False
    assert value_of(await call(op="increment", key="count", by=5)) == 5
    assert value_of(await call(op="increment", key="count", by=-2)) == 3
    assert value_of(await call(op="keys", key="")) == ["count", "fresh", "seen"]
    assert value_of(await call(op="keys", key="co")) == ["count"]
    assert value_of(await call(op="delete", key="count")) is True
    assert value_of(await call(op="delete", key="count")) is False
    assert value_of(await call(op="get", key="seen")) == {"n": 2}


async def test_async_and_sync_tools_share_a_scope(make_server) -> None:
    _, stub = await _state_stub(make_server)
    await state_call(stub, "state_op", scope="principal", op="set", key="k", value="from async")
    assert value_of(await state_call(stub, "state_op_sync", scope="principal", op="get",
                              key="k")) == "from async"


async def test_scopes_are_kept_apart(make_server) -> None:
    _, stub = await _state_stub(make_server)
    await state_call(stub, "state_op", "alice", scope="principal", op="set", key="k", value="a")
    # Another principal's own scope does not see alice's.
    assert value_of(await state_call(stub, "state_op", "bob", scope="principal", op="get",
                              key="k")) is None
    # A run's run scope is its own: the next run starts empty.
    first = await state_call(stub, "state_run_and_tree")
    second = await state_call(stub, "state_run_and_tree")
    one, two = json.loads(first.output), json.loads(second.output)
    assert one["run"] == ["mine"] and two["run"] == ["mine"]
    assert one["tree"] == one["id"] and two["tree"] == two["id"]  # the root is the run
    assert value_of(await state_call(stub, "state_op", scope="run", op="keys", key="")) == []
    assert value_of(await state_call(stub, "state_op", scope="tree", op="keys", key="")) == []


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize(("arguments", "code"), [
    ({"op": "set", "key": "a:b", "value": 1}, "STATE_BAD_KEY"),
    ({"op": "set", "key": "a/b", "value": 1}, "STATE_BAD_KEY"),
    ({"op": "get", "key": "a\nb"}, "STATE_BAD_KEY"),
    ({"op": "get", "key": ""}, "STATE_BAD_KEY"),
    ({"op": "get", "key": "x" * 201}, "STATE_BAD_KEY"),
    ({"op": "set", "key": "big", "value": "x" * 200}, "STATE_VALUE_TOO_LARGE"),
    ({"op": "set", "key": "k", "value": 1, "ttl": -1}, "STATE_BAD_SCOPE"),
    ({"op": "get", "key": "k", "scope": "galaxy"}, "STATE_BAD_SCOPE"),
    ({"op": "set", "key": "g", "value": 1, "scope": "global"}, "STATE_READ_ONLY"),
])
async def test_bad_use_is_refused_with_its_code(make_server, tool, arguments, code) -> None:
    _, stub = await _state_stub(make_server, state_max_value_bytes=100)
    result = await state_call(stub, tool, **arguments)
    expected = (events_pb2.OUTCOME_DENIED if code == "STATE_READ_ONLY"
                else events_pb2.OUTCOME_FAILED)
    assert (result.outcome, result.error.code) == (expected, code), result


async def test_a_non_integer_is_not_incremented(make_server) -> None:
    _, stub = await _state_stub(make_server)
    await state_call(stub, "state_op", op="set", scope="principal", key="k", value="text")
    result = await state_call(stub, "state_op", op="increment", scope="principal", key="k")
    assert result.error.code == "STATE_NOT_INTEGER"


async def test_a_scope_floods_its_quota_and_freeing_space_lets_it_write(make_server) -> None:
    _, stub = await _state_stub(make_server, state_max_bytes_per_scope=100)
    assert value_of(await state_call(stub, "state_op", scope="principal", op="set", key="a",
                              value="x" * 80)) is None
    refused = await state_call(stub, "state_op", scope="principal", op="set", key="b",
                          value="y" * 30)
    assert (refused.outcome, refused.error.code) == (events_pb2.OUTCOME_FAILED,
                                                     "STATE_QUOTA_EXCEEDED")
    # Other principals have quotas of their own; a smaller value in place still fits.
    assert value_of(await state_call(stub, "state_op", "bob", scope="principal", op="set", key="b",
                              value="y" * 30)) is None
    assert value_of(await state_call(stub, "state_op", scope="principal", op="set", key="a",
                              value="x")) is None
    assert value_of(await state_call(stub, "state_op", scope="principal", op="set", key="b",
                              value="y" * 30)) is None


async def test_global_is_written_by_the_named_tools_and_read_by_all(make_server) -> None:
    _, stub = await _state_stub(make_server, state_global_writers="state_op")
    assert value_of(await state_call(stub, "state_op", scope="global", op="set", key="motd",
                              value="hello")) is None
    refused = await state_call(stub, "state_op_sync", scope="global", op="increment", key="n")
    assert refused.error.code == "STATE_READ_ONLY"
    assert value_of(await state_call(stub, "state_op_sync", "bob", scope="global", op="get",
                              key="motd")) == "hello"


async def test_an_entry_ttl_runs_out(make_server) -> None:
    _, stub = await _state_stub(make_server)
    await state_call(stub, "state_op", scope="principal", op="set", key="k", value=1, ttl=0.05)

    async def gone() -> bool:
        return value_of(await state_call(stub, "state_op", scope="principal", op="get",
                                  key="k")) is None

    await eventually(gone, what="the entry's ttl to run out")


async def test_run_state_goes_its_retention_after_the_run_ends(make_server) -> None:
    server, stub = await _state_stub(make_server, state_retention_seconds=0.2)
    result = await state_call(stub, "state_run_and_tree")
    run_id = json.loads(result.output)["id"]
    store = server.runtime.state_store
    # Right after the run, its state is still there for the retention ...
    assert await store.get(f"run:{run_id}", "mine") == json.dumps(run_id)

    async def purged() -> bool:
        return (await store.get(f"run:{run_id}", "mine") is None
                and await store.get(f"tree:{run_id}", "root") is None)

    await eventually(purged, what="the run's state to be purged")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), b"bytes", {1, 2}, object()])
def test_a_value_that_is_not_json_is_refused(value) -> None:
    with pytest.raises(StateValueNotJson):
        encode(value, 1000)


def test_equal_values_are_equal_json_whatever_the_key_order() -> None:
    assert encode({"b": 1, "a": [1, "é"]}, 0) == encode({"a": [1, "é"], "b": 1}, 0) == \
        '{"a":[1,"é"],"b":1}'


async def test_concurrent_increments_from_async_and_sync_tools_add_up(make_server) -> None:
    _, stub = await _state_stub(make_server)
    await asyncio.gather(*(state_call(stub, TOOLS[i % 2], scope="principal", op="increment",
                                 key="hits", repeat=25) for i in range(8)))
    assert value_of(await state_call(stub, "state_op", scope="principal", op="get",
                              key="hits")) == 200


async def test_an_increment_past_2_53_is_refused_and_changes_nothing(make_server) -> None:
    _, stub = await _state_stub(make_server)
    await state_call(stub, "state_op", scope="principal", op="set", key="n", value=2**53 - 2)
    assert value_of(await state_call(stub, "state_op", scope="principal", op="increment",
                              key="n")) == 2**53 - 1
    refused = await state_call(stub, "state_op", scope="principal", op="increment", key="n")
    assert refused.error.code == "STATE_NOT_INTEGER"
    assert value_of(await state_call(stub, "state_op", scope="principal", op="get",
                              key="n")) == 2**53 - 1


async def test_a_store_that_cannot_be_reached_is_refused_unavailable() -> None:
    client = Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    state = RunState(RedisStateStore(client), "principal", "principal:alice", Settings(),
                     writable=True)
    try:
        with pytest.raises(StateUnavailable) as refused:
            await state.set("k", 1)
        assert refused.value.code == "STATE_UNAVAILABLE"
    finally:
        await client.aclose()
