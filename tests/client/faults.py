"""Fault injection for client tests, on a real server and a real network path.

- :class:`Recorder`: a server interceptor that records every ToolService call (method,
  request, metadata) and can refuse the next calls of a method with a given error, exactly
  as the server's own errors would be sent.
- :class:`Proxy`: a TCP proxy in front of the server whose :meth:`Proxy.cut` breaks the
  client's connections while keeping the server's side open, as a network failure between
  the two would: the server never notices, its run goes on, and the client must resume.
  :meth:`Proxy.stall` keeps the connections open but passes nothing more either way, as a
  stopped server or a host gone silent would: only the client's keepalive notices.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from stargrpc.errors import RequestError


@dataclass(frozen=True)
class Seen:
    """One call the server received."""

    method: str
    request: Any
    metadata: dict[str, str]


class Recorder(grpc.aio.ServerInterceptor):
    """Records ToolService calls; :meth:`fail` makes the next calls of a method fail."""

    def __init__(self) -> None:
        self.calls: list[Seen] = []
        self._faults: dict[str, list[RequestError]] = {}

    def fail(self, method: str, error: RequestError, times: int = 1) -> None:
        """Refuses the next ``times`` calls of ``method`` (e.g. "Execute") with ``error``."""
        self._faults.setdefault(method, []).extend([error] * times)

    def seen(self, method: str) -> list[Seen]:
        """The calls of one method, in order."""
        return [call for call in self.calls if call.method == method]

    async def _admit(self, method: str, request: Any, context: grpc.aio.ServicerContext,
                     metadata: dict[str, str]) -> None:
        self.calls.append(Seen(method, request, metadata))
        pending = self._faults.get(method)
        if pending:
            status = pending.pop(0).to_status()
            await context.abort(status.code, status.details, status.trailing_metadata)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/stargrpc.v1.ToolService/"):
            return handler
        method = details.method.rsplit("/", 1)[1]
        metadata = {key: value for key, value in details.invocation_metadata
                    if isinstance(value, str)}
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[Any]:
                await self._admit(method, request, context, metadata)
                async for response in inner_stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer)
        inner_unary = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._admit(method, request, context, metadata)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer)


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port``.

    Attributes:
        port: Where clients connect.
        connections: How many client connections it accepted.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._clients: list[asyncio.StreamWriter] = []
        self._upstreams: list[asyncio.StreamWriter] = []
        self._stalled: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Starts listening; returns the port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def target(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1",
                                                                 self.upstream_port)
        except OSError:  # the server is gone: so is this connection
            writer.transport.abort()
            return
        self._clients.append(writer)
        self._upstreams.append(up_writer)
        for task in (asyncio.create_task(self._pump(reader, up_writer, keep_open=True)),
                     asyncio.create_task(self._pump(up_reader, writer, keep_open=False))):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    keep_open: bool) -> None:
        # Client → server stops when the client's side is cut, but leaves the server's
        # connection open (keep_open); server → client drains into nowhere once cut.
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if writer.is_closing() or writer in self._stalled:
                    continue
                with contextlib.suppress(ConnectionError, OSError):
                    writer.write(data)
                    await writer.drain()
        if not keep_open and not writer.is_closing():
            writer.close()

    def cut(self) -> None:
        """Resets every client connection now (the server's side stays open)."""
        for writer in self._clients:
            writer.transport.abort()
        self._clients.clear()

    def stall(self) -> None:
        """Drops every byte of the connections open now, both ways, and closes none of
        them; connections made later pass as usual."""
        self._stalled.update(self._clients, self._upstreams)

    async def close(self) -> None:
        """Stops listening and closes everything."""
        if self._server is not None:
            self._server.close()
        self.cut()
        for writer in self._upstreams:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
