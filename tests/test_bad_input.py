"""Hostile and malformed Execute requests: each answered by a clear status with details,
and the server keeps serving."""

from __future__ import annotations

import json
import math

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from pydantic import BaseModel

from stargrpc import ToolContext, testing, tool
from stargrpc.errors import InvalidArgument
from stargrpc.runs.arguments import ArgumentLimits, decode_json, validate
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import run_tool, status_details


async def _refused(stub, request: tool_service_pb2.ExecuteRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Execute(request):
            pass
    return caught.value


def _violations(error: grpc.aio.AioRpcError) -> dict[str, str]:
    found = {}
    for detail in status_details(error):
        if isinstance(detail, error_details_pb2.BadRequest):
            found.update({v.field: v.description for v in detail.field_violations})
    return found


async def _still_serving(stub) -> None:
    events = await run_tool(stub, "echo", {"text": "still here"})
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK


async def test_unknown_tool_is_not_found_with_error_info(stub) -> None:
    error = await _refused(stub, tool_service_pb2.ExecuteRequest(tool_name="no_such_tool"))

    assert error.code() == grpc.StatusCode.NOT_FOUND
    info = [d for d in status_details(error) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert info[0].reason == "TOOL_NOT_FOUND"
    assert info[0].metadata["tool_name"] == "no_such_tool"
    await _still_serving(stub)


async def test_empty_tool_name_is_invalid(stub) -> None:
    error = await _refused(stub, tool_service_pb2.ExecuteRequest())

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_name" in _violations(error)
    await _still_serving(stub)


@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "3", "null"])
async def test_arguments_that_are_not_an_object(stub, raw: str) -> None:
    error = await _refused(stub, tool_service_pb2.ExecuteRequest(tool_name="echo",
                                                                 arguments_json=raw))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected a JSON object" in _violations(error)["arguments_json"]
    await _still_serving(stub)


async def test_wrong_types_missing_and_unknown_fields_are_each_named(stub) -> None:
    request = tool_service_pb2.ExecuteRequest(tool_name="count")
    request.arguments.update({"delay": "soon", "colour": "blue"})

    error = await _refused(stub, request)

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = _violations(error)
    assert violations["arguments.to"] == "Field required"
    assert "valid number" in violations["arguments.delay"]
    assert violations["arguments.colour"] == "unknown field"
    await _still_serving(stub)


async def test_lenient_coercion_of_struct_doubles_and_strings(stub) -> None:
    request = tool_service_pb2.ExecuteRequest(tool_name="count")
    request.arguments.update({"to": 2.0, "delay": "0"})  # a Struct carries every number as a double

    events = [r.event async for r in stub.Execute(request)]

    assert events[-1].result.output == "counted to 2"
    events = await run_tool(stub, "count", {"to": "2"})
    assert events[-1].result.output == "counted to 2"


async def test_fractional_integer_is_refused(stub) -> None:
    request = tool_service_pb2.ExecuteRequest(tool_name="count")
    request.arguments.update({"to": 2.5})

    error = await _refused(stub, request)

    assert "fractional" in _violations(error)["arguments.to"]


async def test_five_megabyte_arguments_are_refused_with_the_limit(stub) -> None:
    big = "x" * (5 * 1024 * 1024)
    request = tool_service_pb2.ExecuteRequest(tool_name="echo",
                                              arguments_json=json.dumps({"text": big}))
    error = await _refused(stub, request)

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the limit" in _violations(error)["arguments_json"]
    await _still_serving(stub)


async def test_five_megabyte_struct_is_refused_with_the_limit(stub) -> None:
    request = tool_service_pb2.ExecuteRequest(tool_name="echo")
    request.arguments.update({"text": "x" * (5 * 1024 * 1024)})

    error = await _refused(stub, request)

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the limit" in _violations(error)["arguments"]
    await _still_serving(stub)


async def test_json_nested_a_thousand_deep(stub) -> None:
    deep = '{"text": ' + "[" * 1000 + "]" * 1000 + "}"
    error = await _refused(stub, tool_service_pb2.ExecuteRequest(tool_name="echo",
                                                                 arguments_json=deep))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nested" in _violations(error)["arguments_json"]
    await _still_serving(stub)


async def test_struct_nested_a_thousand_deep(channel, stub) -> None:
    # Encoded by hand: the protobuf library itself refuses to build (or decode) such depth,
    # so the server must answer for a request it cannot even decode.
    value = b"\x1a\x04leaf"  # Value{string_value: "leaf"}
    for _ in range(1000):
        list_value = b"\x0a" + _varint(len(value)) + value  # ListValue{values: [value]}
        value = b"\x32" + _varint(len(list_value)) + list_value  # Value{list_value: ...}
    entry = b"\x0a\x04text\x12" + _varint(len(value)) + value  # map entry "text" -> value
    struct = b"\x0a" + _varint(len(entry)) + entry
    raw = tool_service_pb2.ExecuteRequest(tool_name="echo").SerializeToString()
    raw += b"\x12" + _varint(len(struct)) + struct  # ExecuteRequest.arguments
    raw_execute = channel.unary_stream("/stargrpc.v1.ToolService/Execute")

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in raw_execute(raw):
            pass

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be decoded" in caught.value.details()
    await _still_serving(stub)


async def test_invalid_raw_json(stub) -> None:
    error = await _refused(stub, tool_service_pb2.ExecuteRequest(tool_name="echo",
                                                                 arguments_json='{"text": '))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid JSON" in _violations(error)["arguments_json"]
    error = await _refused(stub, tool_service_pb2.ExecuteRequest(
        tool_name="echo", arguments_json='{"text": NaN}'))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a finite number" in _violations(error)["arguments.text"]
    await _still_serving(stub)


async def test_empty_raw_json_is_refused_and_an_empty_object_is_no_arguments(stub) -> None:
    # "{}" takes a shortcut past the JSON parser; "" (set, but empty) must not.
    empty = tool_service_pb2.ExecuteRequest(tool_name="echo")
    empty.arguments_json = ""
    error = await _refused(stub, empty)
    assert "invalid JSON" in _violations(error)["arguments_json"]
    error = await _refused(stub, tool_service_pb2.ExecuteRequest(tool_name="echo",
                                                                 arguments_json="{}"))
    assert "arguments.text" in _violations(error)  # echo's text is required
    await _still_serving(stub)


async def _audited(server: StargrpcServer) -> list[tuple[str, str]]:
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await audit.writer.flush()
    return [(r.tool, r.outcome) async for r in audit.writer.store.scan()]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
async def test_non_finite_struct_numbers_are_named_and_audited_invalid(make_server, bad) -> None:
    server = await make_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        nested = tool_service_pb2.ExecuteRequest(tool_name="echo")
        nested.arguments.update({"text": "hi", "x": {"y": [1, 2, bad]}})
        flat = tool_service_pb2.ExecuteRequest(tool_name="count")
        flat.arguments.update({"to": 2, "delay": bad})

        nested_error = await _refused(stub, nested)
        flat_error = await _refused(stub, flat)
        await _still_serving(stub)

    for error in (nested_error, flat_error):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ValueError" not in (error.details() or "")
    assert "not a finite number" in _violations(nested_error)["arguments.x.y[2]"]
    assert "not a finite number" in _violations(flat_error)["arguments.delay"]
    assert await _audited(server) == [("echo", "invalid"), ("count", "invalid"), ("echo", "ok")]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_json_numbers_are_named_like_struct_ones(stub, constant) -> None:
    error = await _refused(stub, tool_service_pb2.ExecuteRequest(
        tool_name="count", arguments_json=f'{{"to": 2, "delay": [0, {constant}]}}'))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a finite number" in _violations(error)["arguments.delay[1]"]
    await _still_serving(stub)


async def test_non_finite_numbers_through_the_http_gateway(make_server) -> None:
    server = await make_server(http_port=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http.gateway_port}",
                                 timeout=30) as http:
        reply = await http.post("/v1/tools/count:execute",
                                content=b'{"arguments": {"to": 2, "delay": NaN}}',
                                headers={"content-type": "application/json"})
        again = await http.post("/v1/tools/echo:execute?wait=true",
                                json={"arguments": {"text": "still here"}})

    assert reply.status_code == 400, reply.text
    fields = [violation["field"] for detail in reply.json()["error"]["details"]
              for violation in detail.get("fieldViolations", ())]
    assert fields == ["arguments.delay"]
    assert again.json()["result"]["output"] == "still here"
    assert ("count", "invalid") in await _audited(server)


class Weights(BaseModel):
    weights: list[float]


@tool()
async def weigh(ctx: ToolContext, args: Weights) -> float:
    """Sums the weights (pydantic itself accepts NaN and Infinity for a float)."""
    return sum(args.weights)


async def test_non_finite_numbers_through_the_test_harness() -> None:
    with pytest.raises(InvalidArgument) as caught:
        await testing.run_tool(weigh, {"weights": [1.0, math.inf, math.nan]})

    assert [v.field for v in caught.value.violations] == ["arguments.weights[1]",
                                                          "arguments.weights[2]"]


class Loose(BaseModel, extra="allow"):
    name: str = ""


def test_non_finite_numbers_deep_inside_are_named_and_unknown_names_follow_extra() -> None:
    hidden = {"name": "x", "deep": {"rows": [{"v": 1.5}, (2, -math.inf)], "ok": [True, None]}}
    with pytest.raises(InvalidArgument) as caught:
        validate(Loose, hidden)
    assert [v.field for v in caught.value.violations] == ["arguments.deep.rows[1][1]"]

    # Checked twice, as a second call of the same tool checks it (its names worked out once).
    for _ in range(2):
        assert validate(Loose, {"name": "x", "extra": [1, 2.5]}).model_extra == {
            "extra": [1, 2.5]}
        with pytest.raises(InvalidArgument) as caught:
            validate(Weights, {"weights": [1.0], "wieghts": []})
        assert [v.field for v in caught.value.violations] == ["arguments.wieghts"]


async def test_garbage_bytes_are_invalid_argument(channel, stub) -> None:
    raw_execute = channel.unary_stream("/stargrpc.v1.ToolService/Execute")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in raw_execute(b"\xff\xff\xff\xff\x0f"):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await _still_serving(stub)


async def test_big_integers_survive_the_raw_json_form(stub) -> None:
    events = await run_tool(stub, "echo", None, arguments_json='{"text": "12345678901234567890"}')
    assert events[-1].result.output == "12345678901234567890"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _nested_json(levels: int) -> str:
    """An object ``levels`` objects deep around one number (which sits one level deeper)."""
    return '{"a": ' * levels + "1" + "}" * levels


def test_json_depth_limit_is_exact_at_its_boundary() -> None:
    limits = ArgumentLimits()
    # The number inside 63 objects is at depth 64, the limit; inside 64, one level over.
    assert decode_json(_nested_json(limits.max_depth - 1), limits)
    with pytest.raises(InvalidArgument) as caught:
        decode_json(_nested_json(limits.max_depth), limits)
    assert [v.field for v in caught.value.violations] == ["arguments_json"]
    # Lists count as objects do; empty containers at the limit are within it.
    assert decode_json('{"a": ' + "[" * (limits.max_depth - 1) + "]" * (limits.max_depth - 1)
                       + "}", limits)
    with pytest.raises(InvalidArgument):
        decode_json('{"a": ' + "[" * (limits.max_depth - 1) + "0"
                    + "]" * (limits.max_depth - 1) + "}", limits)


def test_brackets_inside_strings_do_not_make_arguments_deep() -> None:
    limits = ArgumentLimits()
    text = json.dumps({"code": "{[" * 500, "more": {"x": "]}" * 100}})
    assert decode_json(text, limits) == json.loads(text)


@pytest.mark.parametrize(("context", "field"), [
    ({"end_user": "u" * 257}, "context.end_user"),
    ({"channel": "c" * 10_000}, "context.channel"),
    ({"trace_id": "t" * 257, "session_id": "s" * 257}, "context.trace_id"),
    ({"labels": {f"k{i}": "v" for i in range(65)}}, "context.labels"),
    ({"labels": {"k" * 129: "v"}}, "context.labels"),
    ({"labels": {"k": "v" * 1025}}, "context.labels"),
])
async def test_an_invocation_context_over_its_limits_is_refused(stub, context, field) -> None:
    # Each of its texts goes into the run's audit record (end_user as whom the call acts
    # for, which the trail indexes): a caller may not make them as large as a request.
    request = tool_service_pb2.ExecuteRequest(
        tool_name="echo", arguments_json='{"text": "hi"}',
        context=tool_service_pb2.InvocationContext(**context))

    error = await _refused(stub, request)

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in _violations(error), _violations(error)
    await _still_serving(stub)


async def test_an_invocation_context_at_its_limits_runs(stub) -> None:
    request = tool_service_pb2.ExecuteRequest(
        tool_name="echo", arguments_json='{"text": "hi"}',
        context=tool_service_pb2.InvocationContext(
            end_user="u" * 256, channel="c" * 256, trace_id="t" * 256,
            labels={f"{i:03d}" + "k" * 125: "v" * 1024 for i in range(64)}))

    events = [response.event async for response in stub.Execute(request)]

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
