"""Small helpers the tests share."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import httpx
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2
from prometheus_client.parser import text_string_to_metric_families

from bench.ports import free_ports
from stargrpc.audit.record import AuditRecord
from stargrpc.audit.store import default_store_url, open_store
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc

T = TypeVar("T")


async def eventually(check: Callable[[], T | Awaitable[T]], *, within: float = 10.0,
                     interval: float = 0.01, what: str | Callable[[], str] = "") -> T:
    """Waits until ``check()`` (a function or a coroutine function) returns something truthy,
    and returns it; fails the test when it has not within ``within`` seconds.

    For state that no event announces (a row committed by another process, a key expiring
    in Redis); where an event can be awaited, await it instead. ``what`` names what is
    waited for in the failure: a string, or a function read when it fails (to show the
    state then).
    """
    deadline = time.monotonic() + within
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(_not_within(within, what, check, value))
        await asyncio.sleep(interval)


def eventually_sync(check: Callable[[], T], *, within: float = 10.0, interval: float = 0.01,
                    what: str | Callable[[], str] = "") -> T:
    """:func:`eventually` where no event loop runs (a plain fixture starting a process)."""
    deadline = time.monotonic() + within
    while not (value := check()):
        if time.monotonic() >= deadline:
            raise AssertionError(_not_within(within, what, check, value))
        time.sleep(interval)
    return value


def _not_within(within: float, what: str | Callable[[], str], check: object,
                value: object) -> str:
    shown = what() if callable(what) else what
    return f"not within {within} s: {shown or check!r} (last: {value!r})"


async def run_tool(stub: tool_service_pb2_grpc.ToolServiceStub, tool_name: str,
                   arguments: dict[str, Any] | None = None, **fields: Any
                   ) -> list[events_pb2.RunEvent]:
    """Executes a tool and returns every event of the stream."""
    request = tool_service_pb2.ExecuteRequest(tool_name=tool_name, **fields)
    if arguments is not None:
        request.arguments_json = json.dumps(arguments)
    return [response.event async for response in stub.Execute(request)]


def phases(events: list[events_pb2.RunEvent]) -> list[str]:
    """A compact picture of a stream: "START s0", "DELTA s1 '1\\n'", "END s0 COMPLETE", …"""
    shown = []
    for event in events:
        kind = event.WhichOneof("kind")
        if kind == "step":
            phase = events_pb2.StepPhase.Name(event.step.phase).removeprefix("STEP_PHASE_")
            item = f"{phase} {event.step.step.id}"
            if phase == "DELTA":
                item += f" {event.step.delta!r}"
            if phase == "END":
                item += " " + events_pb2.StepStatus.Name(event.step.step.status).removeprefix(
                    "STEP_STATUS_")
            shown.append(item)
        elif kind == "result":
            shown.append("RESULT " + events_pb2.Outcome.Name(event.result.outcome).removeprefix(
                "OUTCOME_"))
        else:
            shown.append(kind.upper())
    return shown


def count_phases(n: int) -> list[str]:
    """The :func:`phases` of the ``count`` tool counting to ``n``."""
    deltas = [f"DELTA s1 '{i}\\n'" for i in range(1, n + 1)]
    return ["START s0", "START s1", *deltas, "END s1 COMPLETE", "END s0 COMPLETE", "RESULT OK"]


#: The :func:`phases` of ``count`` to 3.
COUNT_TO_3 = count_phases(3)


def status_details(error: grpc.aio.AioRpcError) -> list[Any]:
    """The google.rpc detail messages of a failed call, unpacked."""
    raw = dict(error.trailing_metadata() or ()).get("grpc-status-details-bin")
    if raw is None:
        return []
    status = status_pb2.Status.FromString(raw)
    unpacked = []
    for detail in status.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo,
                    error_details_pb2.RetryInfo):
            if detail.Is(cls.DESCRIPTOR):
                message = cls()
                detail.Unpack(message)
                unpacked.append(message)
    return unpacked


def as_dict(message: Any) -> dict[str, Any]:
    """A protobuf message as a dict with proto field names."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


class _Bearer:
    """Adds ``authorization: Bearer <key>`` to every call of a channel."""

    def __init__(self, key: str) -> None:
        self._key = key

    def _with_key(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add("authorization", f"Bearer {self._key}")
        return details._replace(metadata=metadata)


class _UnaryUnaryBearer(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_key(details), request)


class _UnaryStreamBearer(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_key(details), request)


class _StreamUnaryBearer(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any,
                                     requests: Any) -> Any:
        return await continuation(self._with_key(details), requests)


class _StreamStreamBearer(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      requests: Any) -> Any:
        return await continuation(self._with_key(details), requests)


def key_channel(target: str, key: str,
                credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A channel whose every call carries ``key`` as a bearer token (TLS with
    ``credentials``); use it as ``async with key_channel(...) as channel``."""
    interceptors = [cls(key) for cls in (_UnaryUnaryBearer, _UnaryStreamBearer,
                                         _StreamUnaryBearer, _StreamStreamBearer)]
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


async def records_of(server: Any) -> list[AuditRecord]:
    """Every audit record of a server (a StargrpcServer), once it has stopped (and so
    written them all)."""
    await server.stop(grace=5)
    store = open_store(default_store_url(server.settings.state_dir))
    await store.open()
    try:
        return [record async for record in store.scan()]
    finally:
        await store.aclose()


async def stargrpc_cli(*args: str) -> tuple[int, str, str]:
    """Runs ``stargrpc ARGS`` as a user would (a child process, this environment): its exit
    code, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


#: A scrape of ``/metrics``: each sample's value by (name, sorted labels).
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: httpx.AsyncClient) -> Samples:
    """The samples the metrics endpoint ``http`` is a client of serves now."""
    reply = await http.get("/metrics")
    assert reply.status_code == 200
    samples: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def free_port() -> int:
    """A loopback port free when asked, below the ephemeral range (:func:`free_ports`)."""
    return free_ports(1)[0]
