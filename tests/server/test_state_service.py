"""RunStateService on a real server with authentication and the audit on: an admin reads,
writes, deletes and lists every scope (what tools see through ctx.state), anyone else is
refused, every bad request is refused with its status and reason while the server keeps
serving, and every call leaves an audit record naming the scope and key, never the value."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stargrpc.client import AsyncClient, CallError
from stargrpc.v1 import events_pb2, state_pb2, state_pb2_grpc, tool_service_pb2_grpc
from tests.helpers import key_channel, records_of, status_details
from tests.runs_support import collect, execute_request
from tests.state_tools import state_registry

SETTINGS = {"state_max_value_bytes": 256, "state_max_bytes_per_scope": 2048}


async def _admin(make_auth_server: Any) -> tuple[Any, AsyncClient, AsyncClient]:
    auth = await make_auth_server(state_registry(), roles=("admin",), **SETTINGS)
    admin = AsyncClient(key_channel(auth.target, auth.key), own_channel=True)
    bob = AsyncClient(key_channel(auth.target, auth.add_key("bob", "tools")),
                      own_channel=True)
    return auth, admin, bob


async def _tool(auth: Any, **arguments: Any) -> events_pb2.Result:
    async with key_channel(auth.target, auth.key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await collect(stub.Execute(execute_request("state_op", arguments)))
    return events[-1].result


async def test_an_admin_reads_and_writes_what_tools_keep_in_every_scope(
        make_auth_server) -> None:
    auth, admin, _ = await _admin(make_auth_server)
    # A tool's run and tree state, read by the operator by the run's id.
    ran = await _tool(auth, scope="run", op="set", key="progress", value={"done": 3})
    run_id = json.loads(ran.output)["run"]
    assert await admin.get_state("run", "progress", run_id=run_id) == {"done": 3}
    assert await admin.get_state("tree", "progress", run_id=run_id) is None
    # The operator's writes, read by a tool: principal (the key's principal) and global.
    await admin.set_state("principal", "quota", {"left": 10}, principal="tester")
    await admin.set_state("global", "banner", "maintenance at 5")
    got = await _tool(auth, scope="principal", op="get", key="quota")
    assert json.loads(got.output)["value"] == {"left": 10}
    got = await _tool(auth, scope="global", op="get", key="banner")
    assert json.loads(got.output)["value"] == "maintenance at 5"
    # Large integers keep every digit; a ttl is taken.
    await admin.set_state("global", "big", 2**60, ttl=3600)
    assert await admin.get_state("global", "big") == 2**60
    assert await admin.delete_state("global", "big") is True
    assert await admin.delete_state("global", "big") is False
    assert await admin.get_state("global", "big", "gone") == "gone"
    await admin.close()


async def test_list_pages_through_a_scope_with_values(make_auth_server) -> None:
    _, admin, _ = await _admin(make_auth_server)
    for index in range(5):
        await admin.set_state("principal", f"k{index}", index, principal="someone")
    await admin.set_state("principal", "other", "x", principal="someone")
    first = await admin.list_state("principal", principal="someone", prefix="k", page_size=2,
                                   with_values=True)
    assert [(e.key, e.value_json) for e in first.entries] == [("k0", "0"), ("k1", "1")]
    assert first.next_after_key == "k1"
    rest = await admin.list_state("principal", principal="someone", prefix="k",
                                  after_key=first.next_after_key)
    assert [e.key for e in rest.entries] == ["k2", "k3", "k4"]
    assert [e.value_json for e in rest.entries] == ["", "", ""]
    assert rest.next_after_key == ""
    everything = await admin.list_state("principal", principal="someone")
    assert [e.key for e in everything.entries] == ["k0", "k1", "k2", "k3", "k4", "other"]
    await admin.close()


async def test_only_admins_and_every_call_is_audited_without_its_value(
        make_auth_server) -> None:
    auth, admin, bob = await _admin(make_auth_server)
    await admin.set_state("principal", "token", {"secret": "hunter2"}, principal="bob")
    for call in (bob.get_state("principal", "token", principal="bob"),
                 bob.set_state("global", "k", 1),
                 bob.delete_state("principal", "token", principal="bob"),
                 bob.list_state("global")):
        with pytest.raises(CallError) as refused:
            await call
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert refused.value.reason == "PERMISSION_DENIED"
    async with grpc.aio.insecure_channel(auth.target) as anonymous:
        with pytest.raises(grpc.aio.AioRpcError) as unauthenticated:
            await state_pb2_grpc.RunStateServiceStub(anonymous).ListState(
                state_pb2.ListStateRequest(scope=state_pb2.StateScopeRef(
                    scope=state_pb2.STATE_SCOPE_GLOBAL)))
    assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await admin.get_state("principal", "token", principal="bob") == {"secret": "hunter2"}
    await admin.close()
    await bob.close()

    records = [r for r in await records_of(auth.server) if "RunStateService" in r.method]
    shown = [(r.method.rsplit("/", 1)[1], r.principal, r.outcome, r.detail.split(",")[0])
             for r in records]
    assert shown == [
        ("SetState", "tester", "ok", "state set principal:bob key token"),
        ("GetState", "bob", "denied", "state get principal:bob key token"),
        ("SetState", "bob", "denied", "state set global key k"),
        ("DeleteState", "bob", "denied", "state delete principal:bob key token"),
        ("ListState", "bob", "denied", "state list global"),
        ("ListState", "", "unauthenticated", "credentials refused: missing"),
        ("GetState", "tester", "ok", "state get principal:bob key token"),
    ]
    assert records[1].detail.endswith(", refused PERMISSION_DENIED: run state is read and "
                                      "changed by holders of the admin role only")
    assert all("hunter2" not in r.arguments + r.detail + r.result for r in records)
    assert json.loads(records[0].arguments) == {"scope": "principal", "run_id": "",
                                                "principal": "bob", "key": "token"}


def _scope(scope: int = state_pb2.STATE_SCOPE_GLOBAL, **fields: Any) -> state_pb2.StateScopeRef:
    return state_pb2.StateScopeRef(scope=scope, **fields)


RUN = state_pb2.STATE_SCOPE_RUN
BAD = {
    "no scope": (state_pb2.GetStateRequest(key="k"), "scope.scope", "STATE_BAD_SCOPE"),
    "run without a run": (state_pb2.GetStateRequest(scope=_scope(RUN), key="k"),
                          "scope.run_id", "STATE_BAD_SCOPE"),
    "run id with a separator": (
        state_pb2.GetStateRequest(scope=_scope(RUN, run_id="a:b"), key="k"),
        "scope.run_id", "STATE_BAD_SCOPE"),
    "run id and a principal": (
        state_pb2.GetStateRequest(scope=_scope(RUN, run_id="r1", principal="p"), key="k"),
        "scope.principal", "STATE_BAD_SCOPE"),
    "global with a run": (state_pb2.GetStateRequest(scope=_scope(run_id="r1"), key="k"),
                          "scope.run_id", "STATE_BAD_SCOPE"),
    "principal with a control character": (
        state_pb2.GetStateRequest(scope=_scope(state_pb2.STATE_SCOPE_PRINCIPAL,
                                               principal="a\nb"), key="k"),
        "scope.principal", "STATE_BAD_SCOPE"),
    "principal too long": (
        state_pb2.GetStateRequest(scope=_scope(state_pb2.STATE_SCOPE_PRINCIPAL,
                                               principal="p" * 513), key="k"),
        "scope.principal", "STATE_BAD_SCOPE"),
    "unknown scope number": (state_pb2.GetStateRequest(scope=_scope(99), key="k"),
                             "scope.scope", "STATE_BAD_SCOPE"),
    "empty key": (state_pb2.GetStateRequest(scope=_scope()), "key", "STATE_BAD_KEY"),
    "key with a slash": (state_pb2.GetStateRequest(scope=_scope(), key="a/b"), "key",
                         "STATE_BAD_KEY"),
    "key with a NUL": (state_pb2.DeleteStateRequest(scope=_scope(), key="a\0b"), "key",
                       "STATE_BAD_KEY"),
    "key too long": (state_pb2.GetStateRequest(scope=_scope(), key="k" * 201), "key",
                     "STATE_BAD_KEY"),
    "value not JSON": (state_pb2.SetStateRequest(scope=_scope(), key="k", value_json="{x"),
                       "value_json", "STATE_VALUE_NOT_JSON"),
    "value NaN": (state_pb2.SetStateRequest(scope=_scope(), key="k", value_json="NaN"),
                  "value_json", "STATE_VALUE_NOT_JSON"),
    "value missing": (state_pb2.SetStateRequest(scope=_scope(), key="k"), "value_json",
                      "STATE_VALUE_NOT_JSON"),
    "value nested deeply": (state_pb2.SetStateRequest(
        scope=_scope(), key="k", value_json="[" * 100_000 + "]" * 100_000), "value_json",
        "STATE_VALUE_NOT_JSON"),
    "value nested past what readers take": (state_pb2.SetStateRequest(
        scope=_scope(), key="k", value_json="[" * 65 + "]" * 65), "value_json",
        "STATE_VALUE_NOT_JSON"),
    "value too large": (state_pb2.SetStateRequest(scope=_scope(), key="k",
                                                  value_json=json.dumps("x" * 300)),
                        "value_json", "STATE_VALUE_TOO_LARGE"),
    "negative ttl": (state_pb2.SetStateRequest(scope=_scope(), key="k", value_json="1",
                                               ttl_seconds=-1), "ttl_seconds",
                     "STATE_BAD_SCOPE"),
    "infinite ttl": (state_pb2.SetStateRequest(scope=_scope(), key="k", value_json="1",
                                               ttl_seconds=float("inf")), "ttl_seconds",
                     "STATE_BAD_SCOPE"),
    "ttl past ten years": (state_pb2.SetStateRequest(scope=_scope(), key="k", value_json="1",
                                                     ttl_seconds=1e308), "ttl_seconds",
                           "STATE_BAD_SCOPE"),
    "page too large": (state_pb2.ListStateRequest(scope=_scope(), page_size=1001),
                       "page_size", "INVALID_ARGUMENT"),
    "negative page": (state_pb2.ListStateRequest(scope=_scope(), page_size=-1),
                      "page_size", "INVALID_ARGUMENT"),
    "prefix with a colon": (state_pb2.ListStateRequest(scope=_scope(), prefix="a:"),
                            "prefix", "STATE_BAD_KEY"),
    "after_key with a space": (state_pb2.ListStateRequest(scope=_scope(), after_key="a b"),
                               "after_key", "STATE_BAD_KEY"),
}
_METHODS = {state_pb2.GetStateRequest: "GetState", state_pb2.SetStateRequest: "SetState",
            state_pb2.DeleteStateRequest: "DeleteState",
            state_pb2.ListStateRequest: "ListState"}


async def _raw(channel: grpc.aio.Channel, method: str, data: bytes) -> bytes:
    call = channel.unary_unary(f"/stargrpc.v1.RunStateService/{method}")
    return await call(data)


@pytest.mark.parametrize("case", list(BAD))
async def test_each_bad_request_is_refused_precisely_and_the_server_serves_on(
        make_auth_server, case: str) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",), **SETTINGS)
    request, field, reason = BAD[case]
    async with key_channel(auth.target, auth.key) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _raw(channel, _METHODS[type(request)], request.SerializeToString())
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = status_details(refused.value)
        [bad] = [d for d in details if isinstance(d, error_details_pb2.BadRequest)]
        [info] = [d for d in details if isinstance(d, error_details_pb2.ErrorInfo)]
        assert [v.field for v in bad.field_violations] == [field]
        assert info.reason == reason
        stub = state_pb2_grpc.RunStateServiceStub(channel)
        await stub.SetState(state_pb2.SetStateRequest(scope=_scope(), key="k", value_json="1"))
        reply = await stub.GetState(state_pb2.GetStateRequest(scope=_scope(), key="k"))
        assert reply.value_json == "1"


@pytest.mark.parametrize("method", list(_METHODS.values()))
async def test_undecodable_bytes_are_invalid_argument(make_auth_server, method: str) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",))
    async with key_channel(auth.target, auth.key) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _raw(channel, method, b"\xff\xff\xff\xff garbage")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reply = await state_pb2_grpc.RunStateServiceStub(channel).ListState(
            state_pb2.ListStateRequest(scope=_scope()))
        assert list(reply.entries) == []


async def test_a_full_scope_is_resource_exhausted(make_auth_server) -> None:
    _, admin, _ = await _admin(make_auth_server)
    value = "x" * 200
    written = 0
    with pytest.raises(CallError) as full:
        for index in range(20):
            await admin.set_state("global", f"k{index}", value)
            written += 1
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert full.value.reason == "STATE_QUOTA_EXCEEDED"
    assert 0 < written < 20
    assert await admin.delete_state("global", "k0") is True
    await admin.set_state("global", "k0", value)  # the freed space is usable again
    await admin.close()


async def test_reflection_describes_the_service(make_auth_server) -> None:
    auth = await make_auth_server(state_registry(), roles=("admin",))
    async with key_channel(auth.target, auth.key) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]))
        names = [s.name async for reply in replies
                 for s in reply.list_services_response.service]
    assert "stargrpc.v1.RunStateService" in names


async def test_a_value_as_deep_as_allowed_is_written_and_read_back(make_auth_server) -> None:
    """64 levels (MAX_VALUE_DEPTH) is taken and reads back whole; one more is refused
    above — a value Python's parser took some 970 levels deep was written and then could
    not be read back through the HTTP gateway."""
    auth = await make_auth_server(state_registry(), roles=("admin",), **SETTINGS)
    deep = "[" * 63 + "1" + "]" * 63
    async with key_channel(auth.target, auth.key) as channel:
        stub = state_pb2_grpc.RunStateServiceStub(channel)
        await stub.SetState(state_pb2.SetStateRequest(scope=_scope(), key="k", value_json=deep))
        reply = await stub.GetState(state_pb2.GetStateRequest(scope=_scope(), key="k"))

    assert reply.value_json == deep
