"""http_fetch's receipt through a real server: the bytes of every HTTP message it sent and
received, as counted by a raw TCP server on 127.0.0.1 that sees the very bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import run_tool

ALLOW = {"http_fetch_allowlist": ["127.0.0.1"], "http_fetch_allowed_networks": ["127.0.0.1/32"],
         "http_fetch_max_bytes": 100_000, "http_fetch_max_redirects": 3}


@dataclass
class Wire:
    """A one-request-per-connection HTTP server that answers from a script of raw
    responses (by path) and counts every byte read and written."""

    answers: dict[str, bytes]
    read: int = 0
    written: int = 0
    paths: list[str] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length) if length else b""
        self.read += len(head) + len(body)
        path = head.split(b" ", 2)[1].decode()
        self.paths.append(path)
        answer = self.answers[path]
        writer.write(answer)
        self.written += len(answer)
        await writer.drain()
        writer.close()


def _response(status: str, body: bytes, **headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", "Content-Type: text/plain",
             f"Content-Length: {len(body)}", "Connection: close",
             *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture
async def wire() -> AsyncIterator[tuple[Wire, int]]:
    served = Wire({})
    server = await asyncio.start_server(served.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield served, port


@pytest.fixture
async def stub(make_server):
    server = await make_server(**ALLOW)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


async def test_a_post_counts_the_bytes_of_its_request_and_response(stub, wire) -> None:
    served, port = wire
    served.answers["/echo"] = _response("201 Created", b"got it, thanks" * 10)

    events = await run_tool(stub, "http_fetch", {"url": f"http://127.0.0.1:{port}/echo",
                                                 "method": "POST", "body": "x" * 500,
                                                 "headers": {"X-Note": "hello"}})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result.error.message
    assert result.usage.network_bytes_sent == served.read
    assert result.usage.network_bytes_received == served.written
    assert served.read > 500 and served.written > 140
    assert not result.usage.HasField("cpu_user_seconds")  # an in-process tool


async def test_every_redirect_hop_is_counted(stub, wire) -> None:
    served, port = wire
    served.answers["/old"] = _response("302 Found", b"", Location="/new")
    served.answers["/new"] = _response("200 OK", b"moved here\n")

    events = await run_tool(stub, "http_fetch", {"url": f"http://127.0.0.1:{port}/old"})

    usage = events[-1].result.usage
    assert served.paths == ["/old", "/new"]
    assert (usage.network_bytes_sent, usage.network_bytes_received) == (
        served.read, served.written)


async def test_a_refused_fetch_still_reports_that_nothing_crossed(stub) -> None:
    events = await run_tool(stub, "http_fetch", {"url": "http://192.0.2.1/"})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_DENIED
    assert result.usage.HasField("network_bytes_sent")
    assert (result.usage.network_bytes_sent, result.usage.network_bytes_received) == (0, 0)
