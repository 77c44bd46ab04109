"""Calls of a server's own services from inside its process, without a channel.

The MCP endpoint and the HTTP gateway are gRPC clients of the process's own server. Over a
loopback channel each of their calls pays a whole gRPC client and server (HTTP/2 framing,
grpc's core on both sides) on top of the service. :class:`InProcessServer` keeps what a
``grpc.aio.Server`` is given — its method handlers (registered or generic) and its
interceptors, composed as the server serves them — and :class:`InProcessChannel` calls
them directly: the method's handler is found through every interceptor's
``intercept_service``, exactly as the gRPC server finds it, and the behaviour it returns
runs in a task of its own with an :class:`InProcessContext` (a ``grpc.aio.ServicerContext``).

What stays as over a channel:

- requests and responses are serialised and parsed at the boundary (nothing is shared by
  reference), and the server's ``max_receive_message_bytes`` / ``max_send_message_bytes``
  refuse an oversized message with the same RESOURCE_EXHAUSTED;
- a refusal reaches the caller as a ``grpc.aio.AioRpcError`` with the code, details and
  trailing metadata (rich status details included) the handler ended with; a handler that
  raises is UNKNOWN ``Unexpected <class …>: …``, as grpc.aio says it;
- cancelling the call (or closing the channel) cancels the handler's task; a deadline
  (``timeout=``) is the handler's ``time_remaining()`` and ends the call
  DEADLINE_EXCEEDED;
- each call runs in a fresh ``contextvars`` context, as grpc.aio serves each call in a task
  of its own: nothing of the caller's context variables reaches the interceptors.

What differs: :meth:`InProcessContext.peer` is ``inproc:<name>`` (the channel's name, e.g.
``inproc:mcp``), the auth context names the ``inproc`` transport and no certificate, and
the invocation metadata's ``user-agent`` is ``stargrpc-inprocess/<version>``.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, NoReturn, cast

import grpc

from stargrpc import __version__
from stargrpc.server.interceptors._shapes import call_behaviour, responses_of

_LOGGER = logging.getLogger("stargrpc.server.inprocess")

Metadata = Sequence[tuple[str, str | bytes]]

#: What grpc.aio says of a call its own caller cancelled.
_LOCALLY_CANCELLED = "Locally cancelled by application!"

_USER_AGENT = ("user-agent", f"stargrpc-inprocess/{__version__}")

#: Messages a streaming handler may have written ahead of its reader (a channel's flow
#: control window, in messages rather than bytes).
STREAM_WINDOW = 64

_END = object()


class _CallDetails(grpc.HandlerCallDetails):
    """The ``handler_call_details`` an interceptor is given."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str, invocation_metadata: tuple[tuple[str, Any], ...]) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class _Ended(Exception):
    """The status a call ended with, raised inside its own server task."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class InProcessServer:
    """The handlers and interceptors of one gRPC server, for calls from its own process.

    A ``grpc.aio.Server`` keeps what it is given to itself; the server that builds one
    gives the same registrations to this object too (:meth:`registrar`), and the same
    interceptor objects.

    Attributes:
        max_receive_message_bytes: Largest request the server accepts.
        max_send_message_bytes: Largest response the server sends.
    """

    max_receive_message_bytes: int
    max_send_message_bytes: int
    _interceptors: tuple[grpc.aio.ServerInterceptor, ...]
    _generic: list[grpc.GenericRpcHandler]
    _registered: dict[str, grpc.RpcMethodHandler]
    _calls: set[asyncio.Task[None]]
    _stopped: bool

    def __init__(self, interceptors: Sequence[grpc.aio.ServerInterceptor] = (), *,
                 max_receive_message_bytes: int = 4 * 1024 * 1024,
                 max_send_message_bytes: int = 2**31 - 1) -> None:
        """The server whose interceptors are ``interceptors`` (outermost first, as given
        to ``grpc.aio.server``)."""
        self._interceptors = tuple(interceptors)
        self.max_receive_message_bytes = max_receive_message_bytes
        self.max_send_message_bytes = max_send_message_bytes
        self._generic = []
        self._registered = {}
        self._calls = set()
        self._stopped = False

    # -- what a grpc.aio.Server is given --------------------------------------------------

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        """As ``grpc.aio.Server.add_generic_rpc_handlers``."""
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: dict[str, grpc.RpcMethodHandler]
                                       ) -> None:
        """As ``grpc.aio.Server.add_registered_method_handlers``."""
        for name, handler in method_handlers.items():
            self._registered[f"/{service_name}/{name}"] = handler

    def registrar(self, server: grpc.aio.Server) -> grpc.aio.Server:
        """An object to register services on (``add_XServicer_to_server(servicer, it)``)
        that registers them on ``server`` and here (it has only the two methods that
        register)."""
        return cast(grpc.aio.Server, _Registrar(server, self))

    def channel(self, name: str = "local", *, max_send_message_bytes: int = 2**31 - 1,
                max_receive_message_bytes: int = 2**31 - 1) -> InProcessChannel:
        """A channel to this server; its calls' peer is ``inproc:<name>``.

        Args:
            name: Who calls (``mcp``, ``gateway``): the peer the handlers see.
            max_send_message_bytes: Largest request the channel sends (its own limit).
            max_receive_message_bytes: Largest response the channel accepts.
        """
        return InProcessChannel(self, f"inproc:{name}",
                                max_send_message_bytes=max_send_message_bytes,
                                max_receive_message_bytes=max_receive_message_bytes)

    async def stop(self) -> None:
        """Refuses new calls (UNAVAILABLE) and cancels those in flight, as the gRPC
        server's stop does; idempotent."""
        self._stopped = True
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.gather(*calls, return_exceptions=True)

    # -- one call ---------------------------------------------------------------------------

    async def _find_handler(self, details: _CallDetails) -> grpc.RpcMethodHandler | None:
        """The method's handler through every interceptor, as grpc.aio finds it."""

        def query(call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            handler = self._registered.get(call_details.method)
            if handler is not None:
                return handler
            for generic in self._generic:
                handler = generic.service(call_details)
                if handler is not None:
                    return handler
            return None

        interceptors = iter(self._interceptors)

        async def continuation(call_details: grpc.HandlerCallDetails
                               ) -> grpc.RpcMethodHandler | None:
            interceptor = next(interceptors, None)
            if interceptor is None:
                return query(call_details)
            return await interceptor.intercept_service(continuation, call_details)

        return await continuation(details)

    def _start(self, call: _Call) -> None:
        if self._stopped:
            call.finish(grpc.StatusCode.UNAVAILABLE, "the server has stopped")
            return
        # A fresh context, as grpc.aio serves each call in a task of its own: the caller's
        # context variables (its principal, its bound log fields) must not leak in.
        task = asyncio.get_running_loop().create_task(
            self._serve(call), name=f"inproc{call.method}", context=contextvars.Context())
        call.server_task = task
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _serve(self, call: _Call) -> None:
        """Finds the handler, runs it and ends the call with its status."""
        context = call.context
        code, details = grpc.StatusCode.OK, ""
        try:
            handler = await self._find_handler(
                _CallDetails(call.method, context.invocation_metadata()))
            if handler is None:
                raise _Ended(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            if len(call.request) > self.max_receive_message_bytes:
                raise _Ended(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "SERVER: Received message larger than max "
                             f"({len(call.request)} vs. {self.max_receive_message_bytes})")
            await self._run(handler, call)
            code = context.code() or grpc.StatusCode.OK
            details = context.details() or ""
        except _Ended as ended:
            code, details = ended.code, ended.details
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            details = context.details() or ""
        except asyncio.CancelledError:
            # The caller cancelled, its deadline passed, or the server stops: the call's
            # status is already the caller's (or is set here).
            code, details = (grpc.StatusCode.CANCELLED, "the server is stopping")
        except Exception as exc:  # as grpc.aio: the traceback to the log, UNKNOWN (or the
            # code the handler had set) to the caller
            _LOGGER.exception("Unexpected [%s] raised by servicer method [%s]",
                              type(exc).__name__, call.method)
            set_code = context.code()
            code = (set_code if set_code is not None and set_code is not grpc.StatusCode.OK
                    else grpc.StatusCode.UNKNOWN)
            details = f"Unexpected {type(exc)}: {exc}"
        finally:
            context._finish()
        call.finish(code, details)

    async def _run(self, handler: grpc.RpcMethodHandler, call: _Call) -> None:
        """Runs the handler's behaviour in its shape; its responses go to ``call``."""
        context = call.context
        request = (handler.request_deserializer(call.request)
                   if handler.request_deserializer is not None else call.request)
        serialize = handler.response_serializer
        if handler.stream_unary is not None or handler.stream_stream is not None:
            request = _one(request)  # a handler of streamed requests: a stream of one
        if handler.unary_unary is not None or handler.stream_unary is not None:
            behaviour = handler.unary_unary or handler.stream_unary
            response = await call_behaviour(behaviour, request, context)
            code = context.code()
            if code is None or code is grpc.StatusCode.OK:
                await call.put(self._serialized(response, serialize))
            return
        behaviour = handler.unary_stream or handler.stream_stream
        assert behaviour is not None
        if inspect.iscoroutinefunction(behaviour):  # writes with context.write()
            context._writer = lambda message: call.put(self._serialized(message, serialize))
            await behaviour(request, context)
            return
        responses = responses_of(behaviour)(request, context)
        try:
            async for response in responses:
                await call.put(self._serialized(response, serialize))
        finally:
            await responses.aclose()  # type: ignore[attr-defined]

    def _serialized(self, message: Any, serialize: Callable[[Any], bytes] | None) -> bytes:
        data = serialize(message) if serialize is not None else message
        if len(data) > self.max_send_message_bytes:
            raise _Ended(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         "SERVER: Sent message larger than max "
                         f"({len(data)} vs. {self.max_send_message_bytes})")
        return bytes(data)


async def _one(request: Any) -> AsyncIterator[Any]:
    yield request


class _Registrar:
    """Registers each service on a ``grpc.aio.Server`` and on an :class:`InProcessServer`."""

    def __init__(self, server: grpc.aio.Server, inprocess: InProcessServer) -> None:
        self._server = server
        self._inprocess = inprocess

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(handlers)
        self._inprocess.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: dict[str, grpc.RpcMethodHandler]
                                       ) -> None:
        self._server.add_registered_method_handlers(service_name, method_handlers)
        self._inprocess.add_registered_method_handlers(service_name, method_handlers)


class InProcessContext(grpc.aio.ServicerContext):
    """The servicer context of an in-process call: what the handlers and interceptors of
    the gRPC server read and set, kept in this object instead of grpc's core."""

    __slots__ = (
        "_aborted",
        "_call",
        "_callbacks",
        "_code",
        "_deadline",
        "_details",
        "_done",
        "_initial",
        "_metadata",
        "_peer",
        "_trailing",
        "_writer",
    )

    def __init__(self, call: _Call, metadata: tuple[tuple[str, Any], ...], peer: str,
                 deadline: float | None) -> None:
        self._call = call
        self._metadata = metadata
        self._peer = peer
        self._deadline = deadline
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None
        self._trailing: tuple[tuple[str, Any], ...] = ()
        self._initial: tuple[tuple[str, Any], ...] | None = None
        self._aborted = False
        self._done = False
        self._callbacks: list[Callable[[InProcessContext], None]] = []
        self._writer: Callable[[bytes], Any] | None = None

    # -- the call's facts -------------------------------------------------------------------

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, list[bytes]]:
        # No TLS between a process and itself: no certificate names the caller, as on the
        # loopback channel (whose client presents none).
        return {"transport_security_type": [b"inproc"]}

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(self._deadline - self._call.loop.time(), 0.0)

    def cancelled(self) -> bool:
        return self._call.cancelled_by_caller

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[InProcessContext], None]) -> None:
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    # -- the call's status ------------------------------------------------------------------

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Metadata = ()) -> NoReturn:
        if self._aborted:
            raise grpc.aio.UsageError("Abort was already called!")
        if code is grpc.StatusCode.OK:
            _LOGGER.error("abort() called with StatusCode.OK; returning UNKNOWN")
            code = grpc.StatusCode.UNKNOWN
            details = ""
        self._aborted = True
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        await self.abort(status.code, status.details, status.trailing_metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details

    def set_trailing_metadata(self, trailing_metadata: Metadata) -> None:
        self._trailing = tuple(trailing_metadata)

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing

    async def send_initial_metadata(self, initial_metadata: Metadata) -> None:
        if self._initial is not None:
            raise grpc.aio.UsageError("Initial metadata has already been sent")
        self._initial = tuple(initial_metadata)
        if not self._call.initial.done():  # else the call has ended: nobody reads it
            self._call.initial.set_result(self._initial)

    # -- messages ---------------------------------------------------------------------------

    async def read(self) -> NoReturn:
        raise grpc.aio.UsageError("an in-process call has one request, read by its handler")

    async def write(self, message: Any) -> None:
        if self._writer is None:
            raise grpc.aio.UsageError("write() is for a coroutine that streams responses")
        await self._writer(message)

    def set_compression(self, compression: grpc.Compression) -> None:
        """Nothing to compress in-process."""

    def disable_next_message_compression(self) -> None:
        """Nothing to compress in-process."""

    def _finish(self) -> None:
        """The handler has ended: the done callbacks run (once)."""
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                _LOGGER.exception("a done callback of an in-process call failed")


class _Call:
    """One in-process call: its request, its responses, its status."""

    def __init__(self, server: InProcessServer, method: str, request: bytes,
                 metadata: tuple[tuple[str, Any], ...], peer: str, timeout: float | None,
                 max_receive_message_bytes: int, window: int) -> None:
        self.loop = loop = asyncio.get_running_loop()
        self.method = method
        self.request = request
        self.max_receive_message_bytes = max_receive_message_bytes
        self.deadline = loop.time() + timeout if timeout is not None else None
        self.context = InProcessContext(self, metadata, peer, self.deadline)
        self.responses = _Responses(window)
        self.initial: asyncio.Future[tuple[tuple[str, Any], ...]] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple[tuple[str, Any], ...] = ()
        self.cancelled_by_caller = False
        self.server_task: asyncio.Task[None] | None = None
        self.callbacks: list[Callable[[Any], None]] = []
        self.owner: Any = None
        self._timer = (loop.call_at(self.deadline, self.expire)
                       if self.deadline is not None else None)
        server._start(self)

    async def put(self, message: bytes) -> None:
        if len(message) > self.max_receive_message_bytes:
            raise _Ended(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         "CLIENT: Received message larger than max "
                         f"({len(message)} vs. {self.max_receive_message_bytes})")
        await self.responses.put(message)

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        """Ends the call with this status, unless it has one already (the caller's)."""
        if self.code is not None:
            return
        self.code, self.details = code, details
        self.trailing = self.context._trailing
        if self._timer is not None:
            self._timer.cancel()
        if not self.initial.done():
            self.initial.set_result(())
        self.ended.set_result(None)
        self.responses.end()
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(self.owner)

    def cancel(self, code: grpc.StatusCode, details: str) -> bool:
        """Ends the call for its caller and cancels its handler; whether it was going."""
        if self.code is not None:
            return False
        self.cancelled_by_caller = True
        self.finish(code, details)
        if self.server_task is not None:
            self.server_task.cancel()
        return True

    def expire(self) -> None:
        self.context._deadline = -1.0  # passed, whatever the loop's clock resolution says
        self.cancel(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    @property
    def cancelled_by_its_caller(self) -> bool:
        """Whether the call ended CANCELLED because its caller cancelled it (grpc.aio then
        raises CancelledError rather than an AioRpcError)."""
        return self.cancelled_by_caller and self.code is grpc.StatusCode.CANCELLED

    def error(self) -> grpc.aio.AioRpcError:
        assert self.code is not None
        initial = self.initial.result() if self.initial.done() else ()
        return grpc.aio.AioRpcError(
            self.code, grpc.aio.Metadata(*initial), grpc.aio.Metadata(*self.trailing),
            self.details, f"{self.code.name}:{self.details}")


class _Responses:
    """A call's responses on their way to its reader: at most ``window`` written ahead
    (the writer waits beyond), then the end, which stays (every later read sees it)."""

    __slots__ = ("_ended", "_messages", "_reader", "_window", "_writer")

    def __init__(self, window: int) -> None:
        self._messages: collections.deque[bytes] = collections.deque()
        self._window = window
        self._ended = False
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None

    async def put(self, message: bytes) -> None:
        while len(self._messages) >= self._window and not self._ended:
            self._writer = asyncio.get_running_loop().create_future()
            await self._writer
        if self._ended:  # nobody reads any more: the call has ended
            raise asyncio.CancelledError()
        self._messages.append(message)
        _wake(self._reader)

    def end(self) -> None:
        self._ended = True
        _wake(self._reader)
        _wake(self._writer)

    async def get(self) -> bytes | object:
        while not self._messages:
            if self._ended:
                return _END
            self._reader = asyncio.get_running_loop().create_future()
            await self._reader
        message = self._messages.popleft()
        _wake(self._writer)
        return message


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _CallView:
    """What a grpc.aio call object answers besides its messages."""

    def __init__(self, call: _Call, deserialize: Callable[[bytes], Any] | None) -> None:
        self._call = call
        call.owner = self
        self._deserialize = deserialize

    def cancel(self) -> bool:
        """Cancels the call (its handler too); whether it was still going."""
        return self._call.cancel(grpc.StatusCode.CANCELLED, _LOCALLY_CANCELLED)

    def cancelled(self) -> bool:
        return self._call.cancelled_by_its_caller

    def done(self) -> bool:
        return self._call.code is not None

    def time_remaining(self) -> float | None:
        return self._call.context.time_remaining()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._call.code is not None:
            callback(self)
        else:
            self._call.callbacks.append(callback)

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(*await asyncio.shield(self._call.initial))

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        await asyncio.shield(self._call.ended)
        return grpc.aio.Metadata(*self._call.trailing)

    async def code(self) -> grpc.StatusCode:
        await asyncio.shield(self._call.ended)
        assert self._call.code is not None
        return self._call.code

    async def details(self) -> str:
        await asyncio.shield(self._call.ended)
        return self._call.details

    async def debug_error_string(self) -> str:
        await asyncio.shield(self._call.ended)
        return f"{self._call.code}:{self._call.details}"

    async def wait_for_connection(self) -> None:
        """An in-process call is connected from the start."""

    def _raise_if_ended(self) -> NoReturn:
        call = self._call
        if call.cancelled_by_its_caller:
            raise asyncio.CancelledError()
        raise call.error()


class InProcessUnaryUnaryCall(_CallView):
    """A unary call, awaitable for its response as ``grpc.aio.UnaryUnaryCall``."""

    def __await__(self) -> Any:
        return self._response().__await__()

    async def _response(self) -> Any:
        call = self._call
        try:
            message = await call.responses.get()
            await call.ended  # the response counts only with an OK status after it
        except asyncio.CancelledError:  # as grpc.aio: the awaiting task cancels the call
            self.cancel()
            raise
        if message is _END or call.code is not grpc.StatusCode.OK:
            self._raise_if_ended()
        data = cast(bytes, message)
        return self._deserialize(data) if self._deserialize is not None else data


class InProcessUnaryStreamCall(_CallView):
    """A call streaming its responses, read as ``grpc.aio.UnaryStreamCall``: ``read()``
    (``grpc.aio.EOF`` at the end) or ``async for``."""

    async def read(self) -> Any:
        """The next response, or ``grpc.aio.EOF``.

        Raises:
            grpc.aio.AioRpcError: The call ended with another status than OK.
            asyncio.CancelledError: The call was cancelled by its caller.
        """
        call = self._call
        if call.cancelled_by_its_caller:
            raise asyncio.CancelledError()
        message = await call.responses.get()
        if message is _END:
            if call.code is grpc.StatusCode.OK:
                return grpc.aio.EOF
            self._raise_if_ended()
        data = cast(bytes, message)
        return self._deserialize(data) if self._deserialize is not None else data

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        while (response := await self.read()) is not grpc.aio.EOF:
            yield response


class _MultiCallable:
    def __init__(self, channel: InProcessChannel, method: str,
                 serialize: Callable[[Any], bytes] | None,
                 deserialize: Callable[[bytes], Any] | None, streaming: bool) -> None:
        self._channel = channel
        self._method = method
        self._serialize = serialize
        self._deserialize = deserialize
        self._streaming = streaming

    def __call__(self, request: Any, *, timeout: float | None = None,
                 metadata: Metadata | None = None, credentials: Any = None,
                 wait_for_ready: bool | None = None, compression: Any = None) -> Any:
        channel = self._channel
        if metadata and not _valid_metadata(metadata):
            # As grpc's core refuses it before sending anything: handlers written for gRPC
            # may rely on metadata being printable ASCII under lower-case keys.
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "Invalid metadata",
                                       "INTERNAL:Invalid metadata")
        data = self._serialize(request) if self._serialize is not None else request
        call_metadata = (_USER_AGENT, *metadata) if metadata else (_USER_AGENT,)
        call = _Call(channel._server, self._method, bytes(data), call_metadata,
                     channel.peer, timeout, channel.max_receive_message_bytes,
                     STREAM_WINDOW if self._streaming else 1)
        if len(data) > channel.max_send_message_bytes:  # the channel's own limit first
            call.cancel(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "CLIENT: Sent message larger than max "
                        f"({len(data)} vs. {channel.max_send_message_bytes})")
            call.cancelled_by_caller = False
        view: _CallView = (InProcessUnaryStreamCall(call, self._deserialize) if self._streaming
                           else InProcessUnaryUnaryCall(call, self._deserialize))
        channel._track(view)
        return view


_METADATA_KEY = re.compile(r"[0-9a-z_.-]+\Z")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*\Z")


def _valid_metadata(metadata: Metadata) -> bool:
    """Whether grpc's core would send ``metadata``: lower-case keys of its alphabet, and
    printable ASCII values except under ``-bin`` keys (bytes)."""
    for key, value in metadata:
        if not _METADATA_KEY.match(key):
            return False
        if key.endswith("-bin"):
            if not isinstance(value, bytes | str):
                return False
        elif not isinstance(value, str) or not _METADATA_VALUE.match(value):
            return False
    return True


class InProcessChannel(grpc.aio.Channel):
    """The ``grpc.aio.Channel`` calls generated stubs make (unary requests), served by an
    :class:`InProcessServer` in this process.

    Attributes:
        peer: What the handlers see as the calls' peer (``inproc:<name>``).
        max_send_message_bytes: Largest request sent.
        max_receive_message_bytes: Largest response accepted.
    """

    def __init__(self, server: InProcessServer, peer: str, *,
                 max_send_message_bytes: int, max_receive_message_bytes: int) -> None:
        self._server = server
        self.peer = peer
        self.max_send_message_bytes = max_send_message_bytes
        self.max_receive_message_bytes = max_receive_message_bytes
        self._active: set[_CallView] = set()
        self._closed = False

    def _track(self, view: _CallView) -> None:
        if self._closed:
            view._call.cancel(grpc.StatusCode.CANCELLED, _LOCALLY_CANCELLED)
            return
        if view._call.code is None:
            self._active.add(view)
            view._call.callbacks.append(self._active.discard)

    def unary_unary(self, method: str, request_serializer: Callable[[Any], bytes] | None = None,
                    response_deserializer: Callable[[bytes], Any] | None = None,
                    _registered_method: bool | None = False) -> _MultiCallable:
        """As ``grpc.aio.Channel.unary_unary``."""
        return _MultiCallable(self, method, request_serializer, response_deserializer, False)

    def unary_stream(self, method: str,
                     request_serializer: Callable[[Any], bytes] | None = None,
                     response_deserializer: Callable[[bytes], Any] | None = None,
                     _registered_method: bool | None = False) -> _MultiCallable:
        """As ``grpc.aio.Channel.unary_stream``."""
        return _MultiCallable(self, method, request_serializer, response_deserializer, True)

    def stream_unary(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Streamed requests are not served in-process (no stargrpc method has them)."""
        raise NotImplementedError("an in-process channel calls unary-request methods only")

    def stream_stream(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Streamed requests are not served in-process (no stargrpc method has them)."""
        raise NotImplementedError("an in-process channel calls unary-request methods only")

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        """Always READY while open."""
        return (grpc.ChannelConnectivity.SHUTDOWN if self._closed
                else grpc.ChannelConnectivity.READY)

    async def channel_ready(self) -> None:
        """Ready from the start."""

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity
                                    ) -> None:
        """The state changes only when the channel is closed."""
        raise NotImplementedError("an in-process channel has no connectivity to watch")

    async def close(self, grace: float | None = None) -> None:
        """Cancels the calls still going (as closing a channel does) and refuses new ones."""
        self._closed = True
        for view in list(self._active):
            view.cancel()
        self._active.clear()

    async def __aenter__(self) -> InProcessChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
