"""Hostile input at a live server process (hypothesis): random and mutated ExecuteRequest,
WatchRunRequest and CancelRunRequest bytes, and random field values. Every reply must be a
well-formed status (a refusal, never UNKNOWN or INTERNAL) or a well-formed stream, and the
server must serve a normal call afterwards."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargrpc.registry import bundled_tools_dir
from stargrpc.v1 import events_pb2, tool_service_pb2
from tests.procs import ServerProcess, serve
from tests.runs_support import execute_request

SERVICE = "/stargrpc.v1.ToolService/"
#: Codes a refused request may get; anything else (UNKNOWN, INTERNAL, …) is a server bug.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}

FUZZ = settings(max_examples=100, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server process for the whole module, with only harmless tools: random arguments
    must never reach a tool that runs commands."""
    tools = tmp_path_factory.mktemp("fuzz-tools")
    for name in ("echo.py", "count.py"):
        shutil.copy(bundled_tools_dir() / name, tools / name)
    with serve(tmp_path_factory.mktemp("fuzz-state"), "--tools-dir", str(tools),
               STARGRPC_BUNDLED_TOOLS="false", STARGRPC_ENTRY_POINT_TOOLS="false") as server:
        yield server


@pytest.fixture(scope="module")
def channel(live: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(live.target) as chan:
        yield chan


def _valid_execute() -> bytes:
    return execute_request("count", {"to": 3}, idempotency_key="k").SerializeToString()


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    buffer = bytearray(data)
    for kind, position, value in edits:
        if kind == 1 or not buffer:
            buffer.insert(position % (len(buffer) + 1), value)
        elif kind == 0:
            buffer[position % len(buffer)] = value
        else:
            del buffer[position % len(buffer)]
    return bytes(buffer)


#: The reply type of each unary method fuzzed here.
_UNARY_REPLIES = {"CancelRun": tool_service_pb2.CancelRunResponse,
                  "ApproveRun": tool_service_pb2.ApproveRunResponse}


def _check_raw(channel: grpc.Channel, method: str, payload: bytes) -> None:
    """Sends ``payload`` as the request bytes of ``method`` and checks the reply's shape.
    (Without serializers the channel sends and returns raw bytes.)"""
    try:
        if method in _UNARY_REPLIES:
            reply = channel.unary_unary(SERVICE + method)(payload, timeout=20)
            _UNARY_REPLIES[method].FromString(reply)
            return
        call = channel.unary_stream(SERVICE + method)(payload, timeout=20)
        # ExecuteResponse and WatchRunResponse share their shape: {event = 1}.
        events = [tool_service_pb2.ExecuteResponse.FromString(raw).event for raw in call]
    except grpc.RpcError as error:
        assert error.code() in REFUSALS, (error.code(), error.details())
        return
    _check_stream(events)


def _check_stream(events: list[events_pb2.RunEvent]) -> None:
    if not events:  # WatchRun after the last seq of a finished run: an empty stream
        return
    first = events[0].seq
    assert [e.seq for e in events] == list(range(first, first + len(events)))
    assert events[-1].HasField("result")
    assert sum(e.HasField("result") for e in events) == 1


@FUZZ
@given(method=st.sampled_from(["Execute", "WatchRun", "CancelRun", "ApproveRun"]),
       payload=st.binary(max_size=300))
def test_random_bytes(channel: grpc.Channel, method: str, payload: bytes) -> None:
    _check_raw(channel, method, payload)


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 500), st.integers(0, 255)),
                      min_size=1, max_size=8))
def test_mutated_execute_requests(channel: grpc.Channel,
                                  edits: list[tuple[int, int, int]]) -> None:
    _check_raw(channel, "Execute", _mutate(_valid_execute(), edits))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@settings(FUZZ, max_examples=60)  # each example may really run a tool
@given(tool=st.sampled_from(["echo", "count", ""]) | st.text(max_size=80),
       arguments=st.dictionaries(st.sampled_from(["to", "text", "x"]) | st.text(max_size=8),
                                 json_values, max_size=4),
       raw_json=st.none() | st.text(max_size=100),
       key=st.text(max_size=300), catalog_hash=st.text(max_size=20))
def test_random_execute_fields(channel: grpc.Channel, tool: str, arguments: dict[str, object],
                               raw_json: str | None, key: str, catalog_hash: str) -> None:
    request = tool_service_pb2.ExecuteRequest(tool_name=tool, idempotency_key=key,
                                              catalog_hash=catalog_hash)
    request.arguments_json = raw_json if raw_json is not None else json.dumps(arguments)
    _check_raw(channel, "Execute", request.SerializeToString())


@FUZZ
@given(run_id=st.text(max_size=100), after_seq=st.integers(0, 2**64 - 1),
       reason=st.text(max_size=600))
def test_random_watch_and_cancel_requests(channel: grpc.Channel, run_id: str, after_seq: int,
                                          reason: str) -> None:
    _check_raw(channel, "WatchRun", tool_service_pb2.WatchRunRequest(
        run_id=run_id, after_seq=after_seq).SerializeToString())
    _check_raw(channel, "CancelRun", tool_service_pb2.CancelRunRequest(
        run_id=run_id, reason=reason).SerializeToString())


@FUZZ
@given(run_id=st.text(max_size=150), approval_id=st.text(max_size=150),
       decision=st.integers(-3, 5), reason=st.text(max_size=1100),
       digest=st.text(alphabet="0123456789abcdefABCDEF", max_size=70))
def test_random_approve_requests(channel: grpc.Channel, run_id: str, approval_id: str,
                                 decision: int, reason: str, digest: str) -> None:
    _check_raw(channel, "ApproveRun", tool_service_pb2.ApproveRunRequest(
        run_id=run_id, approval_id=approval_id, decision=decision,  # type: ignore[arg-type]
        reason=reason, arguments_digest=digest).SerializeToString())


def test_the_server_serves_normally_after_the_fuzzing(live: ServerProcess,
                                                      channel: grpc.Channel) -> None:
    # Runs after the fuzz tests above (file order), against the same process.
    call = channel.unary_stream(SERVICE + "Execute")(
        execute_request("count", {"to": 2}).SerializeToString(), timeout=20)
    events = [tool_service_pb2.ExecuteResponse.FromString(raw).event for raw in call]

    assert live.proc.poll() is None
    assert events[-1].result.output == "counted to 2"
    _check_stream(events)

