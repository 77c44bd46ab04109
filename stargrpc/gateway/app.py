"""The HTTP gateway: JSON and Server-Sent Events in front of the ToolService.

Routes:

- ``GET  /``                              the live progress page (static HTML + JS)
- ``GET  /static/…``                      its CSS and ES modules (``no-cache``: revalidated)
- ``GET  /v1/tools``                      the catalog (``ETag`` = catalog hash)
- ``POST /v1/tools/{name}:execute``       start a run: 202 with its URLs; ``?wait=true``:
  200 with the Result; ``Accept: text/event-stream``: the run's events as SSE
- ``GET  /v1/capabilities``               what this server offers the page (steering, …)
- ``GET  /v1/runs``                       ListRuns: ``?tool=&state=&outcome=&page_size=
  &page_token=&root_run_id=&parent_run_id=&lane=`` (each run with its ``parent_run_id``,
  ``root_run_id``, ``depth`` and ``lane``)
- ``GET  /v1/runs/events``                the first page of ListRuns as SSE (``runs``
  events), sent again whenever it changes
- ``GET  /v1/runs/{run_id}/events``       the run's events as SSE, replayed after
  ``Last-Event-ID`` (or ``?after_seq=``), then live until the Result
- ``POST /v1/runs/{run_id}:cancel``       CancelRun
- ``POST /v1/runs/{run_id}:steer``        SteerRun: ``{"message": "…"}``
- ``POST /v1/runs/{run_id}:approve``      ApproveRun: ``{"approval_id": "…", "decision":
  "approve" | "deny", "reason": "…", "arguments_digest": "…"}``
- ``POST /v1/sessions``                   CreateSession: ``{"kind": "python", …}``
- ``GET  /v1/sessions``                   ListSessions (the caller's; ``?files=true``)
- ``POST /v1/sessions/{session_id}:close`` CloseSession
  (an execute body's ``session_id`` runs the call in that session)

Credentials travel in ``Authorization: Bearer …`` exactly as in gRPC metadata; the gateway
forwards them (with the W3C trace context) and never looks at them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

import grpc
from google.protobuf import any_pb2, json_format
from google.rpc import error_details_pb2
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stargrpc.forwarded import ForwardedClient, peer_of
from stargrpc.gateway.client import FORWARDED_HEADERS, GatewayClient, Metadata
from stargrpc.gateway.http_errors import (
    MalformedRequest,
    error_body,
    http_error,
    is_run_finished,
    rpc_error_response,
)
from stargrpc.gateway.runs_watch import RunListWatch, runs_json
from stargrpc.gateway.sse import (
    EventSource,
    QueueSource,
    WatchSource,
    event_json,
    sse_stream,
)
from stargrpc.gateway.state_api import BodyRefused, StateApi
from stargrpc.http_guard import RequestGuard
from stargrpc.text import is_text
from stargrpc.v1 import events_pb2, tool_service_pb2

STATIC_DIR = Path(__file__).parent / "static"

#: How long GET /events waits for the first event (or the refusal) before it answers
#: 200 and starts streaming: an unknown run or a refused caller gets a proper HTTP error;
#: a run that is quiet right now gets its stream (a later failure is an ``error`` event).
FIRST_EVENT_WAIT_SECONDS = 2.0

#: On shutdown, how long open event streams get to deliver what is in flight (the Results of
#: the runs the drain just ended) before they are cut.
STREAM_CLOSE_GRACE_SECONDS = 3.0

SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}

SECURITY_HEADERS = {
    # Images may come from any https URL: a tool's `image` rich message names one (never
    # plain http, which anyone on the path could swap); the page sends them no referrer.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob: https:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class JsonBody(BaseModel):
    """A JSON body the gateway turns into a request: no unknown field, and no string with a
    lone surrogate in it."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _has_utf8_form(cls, value: Any) -> Any:
        # JSON may spell a lone surrogate ("\ud800") and json.loads keeps it, but a
        # protobuf string has no room for it: refused here as bad input, as gRPC refuses it
        # in arguments_json, not left to fail as the request is built (a 500). The dicts
        # are not looked into: arguments travel escaped (json.dumps) for the server to
        # refuse, and ParseDict refuses such a string in context.
        if isinstance(value, str) and not is_text(value):
            raise ValueError("a lone surrogate (an escape such as \\ud800 that is not half "
                             "of a pair) stands for no Unicode character")
        return value


class ExecuteBody(JsonBody):
    """The JSON body of ``POST /v1/tools/{name}:execute`` (ExecuteRequest without the name)."""

    arguments: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: str = ""
    catalog_hash: str = ""
    context: dict[str, Any] = Field(default_factory=dict)
    parent_run_id: str = ""
    session_id: str = ""
    session_no_wait: bool = False
    lane: str = ""
    # Within the contract's int32; the server says what it takes (0 to 1000).
    priority: int = Field(0, ge=-2**31, le=2**31 - 1)
    max_wait_seconds: float = 0.0


class SessionBody(JsonBody):
    """The JSON body of ``POST /v1/sessions`` (CreateSessionRequest)."""

    kind: str = "python"
    ttl_seconds: int = Field(0, ge=0, le=2**32 - 1)
    idle_seconds: int = Field(0, ge=0, le=2**32 - 1)
    memory_mb: int = Field(0, ge=0, le=2**32 - 1)
    cpu_seconds: int = Field(0, ge=0, le=2**32 - 1)
    disk_mb: int = Field(0, ge=0, le=2**32 - 1)


class NoBody(JsonBody):
    """An empty JSON body (or none)."""


class CancelBody(JsonBody):
    """The JSON body of ``POST /v1/runs/{run_id}:cancel`` (optional)."""

    reason: str = ""


class SteerBody(JsonBody):
    """The JSON body of ``POST /v1/runs/{run_id}:steer``."""

    message: str


class ApproveBody(JsonBody):
    """The JSON body of ``POST /v1/runs/{run_id}:approve``."""

    approval_id: str
    decision: Literal["approve", "deny"]
    reason: str = ""
    arguments_digest: str = ""


_Body = TypeVar("_Body", bound=BaseModel)


class _BadRequest(Exception):
    def __init__(self, message: str, violations: list[tuple[str, str]] | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.violations = violations or []
        self.status = status

    def response(self) -> JSONResponse:
        details = []
        if self.violations:
            packed = any_pb2.Any()
            packed.Pack(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                for f, d in self.violations]))
            details.append(json_format.MessageToDict(packed))
        code = "INVALID_ARGUMENT" if self.status == 400 else "RESOURCE_EXHAUSTED"
        return MalformedRequest(error_body(self.status, code, self.message, details),
                                status_code=self.status)


class _Unauthenticated(_BadRequest):
    """The server refused the credentials of a request whose body was still coming: its
    answer is that refusal (a 401), not a refusal of the body."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(error.details() or "unauthenticated", status=401)
        self.error = error

    def response(self) -> JSONResponse:
        return rpc_error_response(self.error)


class _CallerStream(StreamingResponse):
    """An SSE response that gives back its caller's stream slot once it is over, sent or
    not (a client gone before it started never runs its body)."""

    def __init__(self, chunks: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            release, self._release = self._release, lambda: None
            release()


def _caller_key(request: Request) -> str:
    """Who holds a stream, for :data:`MAX_STREAMS_PER_CALLER`: its credentials (the
    server has accepted them by then), else its address (a server without
    authentication)."""
    credentials = request.headers.get("authorization")
    if credentials:
        # The token as the server reads it: "bearer" in any case and the spaces around
        # the token change nothing, so they make no other caller.
        scheme, _, token = credentials.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            credentials = token.strip()
        return "credentials:" + hashlib.sha256(credentials.encode("utf-8", "replace")
                                               ).hexdigest()
    return "address:" + (request.client.host if request.client else "")


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every HTTP response (page and API alike), and
    ``Cache-Control: no-store`` to the API's unless a route set its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        api = scope["path"].startswith("/v1/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
                if api:
                    # A caller's runs, sessions and state are kept by no cache, the
                    # browser's own (on disk) included, unless the route says otherwise.
                    headers.setdefault("Cache-Control", "no-store")
            await send(message)

        await self.app(scope, receive, send_with_headers)


class PageFiles(StaticFiles):
    """The page's CSS and ES modules, revalidated on every load (``Cache-Control:
    no-cache``, answered 304 while unchanged), as the page itself is: after an upgrade a
    browser must not run a fresh module beside a stale one it imports."""

    def file_response(self, full_path: str | os.PathLike[str], stat_result: os.stat_result,
                      scope: Scope, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers["Cache-Control"] = "no-cache"
        return response


#: What an Authorization header that is not printable ASCII is forwarded as: a bearer
#: token that no key or token can be.
_UNPRINTABLE_CREDENTIALS = "Bearer (not-printable-ascii)"


def call_metadata(request: Request, forwarded: ForwardedClient | None = None) -> Metadata:
    """The gRPC metadata of a call made for ``request``: its credentials and trace context,
    and the HTTP client's address — vouched for with ``forwarded`` (the server's own, which
    its audit checks), so that the audit records that address as the call's peer."""
    metadata = []
    for name in FORWARDED_HEADERS:
        values = request.headers.getlist(name)
        if name == "authorization" and len(values) > 1:
            # Two credentials: which counts is not for the gateway to pick (a proxy may have
            # added its own after the client's); sent as two, refused as in gRPC.
            metadata += [(name, _UNPRINTABLE_CREDENTIALS)] * 2
            continue
        value = values[0] if values else ""
        if not value:
            continue
        if not (value.isascii() and value.isprintable()):
            # Not a metadata value gRPC sends: credentials of that kind are refused as any
            # wrong ones are (a 401, not the channel's error); trace context is dropped.
            if name == "authorization":
                metadata.append((name, _UNPRINTABLE_CREDENTIALS))
            continue
        metadata.append((name, value))
    if request.client is not None:
        metadata.append(("x-forwarded-for", request.client.host))  # informative only
        if forwarded is not None:
            metadata += forwarded.metadata(peer_of(request.client.host))
    return metadata


class Gateway:
    """The HTTP gateway of one server: a gRPC client of it plus the Starlette app.

    Attributes:
        client: The gRPC client of the server (in-process when given its channel).
        app: The ASGI app.
        runs_watch: The polls behind the live run lists (``GET /v1/runs/events``).
    """

    client: GatewayClient
    app: Starlette
    runs_watch: RunListWatch
    _closing: asyncio.Event
    _max_body_bytes: int
    _forwarded: ForwardedClient | None
    _open_streams: int
    _streams_by_caller: dict[str, int]
    _no_open_streams: asyncio.Event

    def __init__(self, grpc_target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None,
                 max_body_bytes: int = 8 * 1024 * 1024,
                 allowed_hosts: Iterable[str] = (),
                 allowed_origins: Iterable[str] = (),
                 forwarded: ForwardedClient | None = None,
                 channel: grpc.aio.Channel | None = None) -> None:
        """A gateway whose calls go to ``grpc_target``.

        Args:
            grpc_target: The server's gRPC address.
            credentials: TLS roots for a server that serves TLS.
            server_name: The name expected in the server's certificate.
            max_body_bytes: Largest request body read.
            allowed_hosts: Host names answered besides IP addresses and localhost
                (:class:`~stargrpc.http_guard.RequestGuard`).
            allowed_origins: Origins allowed to call besides the page's own.
            forwarded: The server's voucher for the HTTP client's address (the audit
                interceptor's), so that the audit records that client as the peer.
            channel: The in-process channel of the server, when it runs in this process
                (its calls then skip the loopback network).

        Raises:
            ValueError: An allowed host or origin is malformed.
        """
        self.client = GatewayClient(grpc_target, credentials=credentials,
                                    server_name=server_name, channel=channel)
        self._closing = asyncio.Event()
        self.runs_watch = RunListWatch(self.client, self._closing)
        self._max_body_bytes = max_body_bytes
        self._forwarded = forwarded
        self._open_streams = 0
        self._streams_by_caller = {}
        self._no_open_streams = asyncio.Event()
        self._no_open_streams.set()
        api = [
            Route("/v1/tools", self.list_tools, methods=["GET"]),
            Route("/v1/tools/{name}:execute", self.execute, methods=["POST"]),
            Route("/v1/capabilities", self.capabilities, methods=["GET"]),
            Route("/v1/runs", self.list_runs, methods=["GET"]),
            Route("/v1/runs/events", self.watch_runs, methods=["GET"]),
            Route("/v1/runs/{run_id}/events", self.events, methods=["GET"]),
            Route("/v1/runs/{run_id}:cancel", self.cancel, methods=["POST"]),
            Route("/v1/runs/{run_id}:steer", self.steer, methods=["POST"]),
            Route("/v1/runs/{run_id}:approve", self.approve, methods=["POST"]),
            *StateApi(self.client, self._metadata, self._state_body).routes,
            Route("/v1/sessions", self.create_session, methods=["POST"]),
            Route("/v1/sessions", self.list_sessions, methods=["GET"]),
            Route("/v1/sessions/{session_id}:close", self.close_session, methods=["POST"]),
        ]
        self.app = Starlette(
            routes=[
                Route("/", self.page, methods=["GET"]),
                Mount("/static", app=PageFiles(directory=STATIC_DIR), name="static"),
                *(Route(route.path, self._credentials_first(route.endpoint),
                        methods=list(route.methods or ())) for route in api),
            ],
            # Outermost first: refusals of the guard carry the security headers too.
            middleware=[Middleware(SecurityHeaders),
                        Middleware(RequestGuard, allowed_hosts=list(allowed_hosts),
                                   allowed_origins=list(allowed_origins))],
            exception_handlers={HTTPException: _http_exception},
        )

    async def start(self) -> None:
        """Opens the gRPC channel."""
        await self.client.start()

    async def streams_closed(self) -> None:
        """Returns once no event stream is open."""
        await self._no_open_streams.wait()

    async def aclose(self, grace: float = STREAM_CLOSE_GRACE_SECONDS) -> None:
        """Lets open event streams finish for up to ``grace`` seconds, ends the rest
        (their clients reconnect elsewhere with Last-Event-ID) and closes the channel."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.streams_closed(), grace)
        self._closing.set()
        self.runs_watch.wake_all()  # a stream waiting for its poll's next answer ends now
        await self.client.aclose()

    def _stream(self, request: Request, source: EventSource | AsyncIterator[bytes],
                run_id: str = "") -> Response:
        """The SSE response of ``source``, or 429 when the caller already has
        :data:`MAX_STREAMS_PER_CALLER` open (``run_id``: the run a refused stream was of,
        named in the refusal)."""
        caller = _caller_key(request)
        if self._streams_by_caller.get(caller, 0) >= MAX_STREAMS_PER_CALLER:
            if isinstance(source, EventSource):
                source.close()  # (a run list's generator has not started: nothing to end)
            message = (f"too many event streams open with these credentials (at most "
                       f"{MAX_STREAMS_PER_CALLER}): close one first")
            if run_id:
                message += f"; the run {run_id} goes on, at /v1/runs/{run_id}/events"
            return JSONResponse(error_body(429, "RESOURCE_EXHAUSTED", message),
                                status_code=429, headers={"Retry-After": "5"})
        self._streams_by_caller[caller] = self._streams_by_caller.get(caller, 0) + 1

        def release() -> None:
            left = self._streams_by_caller.get(caller, 0) - 1
            if left > 0:
                self._streams_by_caller[caller] = left
            else:
                self._streams_by_caller.pop(caller, None)

        chunks = (sse_stream(source, self._closing) if isinstance(source, EventSource)
                  else source)

        async def counted() -> AsyncIterator[bytes]:
            self._open_streams += 1
            self._no_open_streams.clear()
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                self._open_streams -= 1
                if not self._open_streams:
                    self._no_open_streams.set()

        return _CallerStream(counted(), release)

    def _credentials_first(self, endpoint: Callable[[Request], Awaitable[Response]]
                           ) -> Callable[[Request], Awaitable[Response]]:
        """``endpoint``, except that its own refusal of a malformed request (a
        :class:`MalformedRequest`: 400, 413) gives way to the server's 401 when the
        request's credentials are refused: a caller who may not call learns nothing of how
        its request would have been read. The credentials are checked only then (a
        ListTools of the caller's, within :data:`_CREDENTIALS_CHECK_SECONDS`), so a
        well-formed request — and a refusal of the server's, made after its own check of
        the credentials — pays nothing for it."""

        async def checked(request: Request) -> Response:
            response = await endpoint(request)
            if not isinstance(response, MalformedRequest):
                return response
            try:
                async with asyncio.timeout(_CREDENTIALS_CHECK_SECONDS):
                    await self.client.list_tools(self._metadata(request))
            except grpc.aio.AioRpcError as error:
                if error.code() is grpc.StatusCode.UNAUTHENTICATED:
                    return rpc_error_response(error)
            except TimeoutError:
                pass  # the refusal stands: the server did not say in time
            return response

        return checked

    def _metadata(self, request: Request) -> Metadata:
        return call_metadata(request, self._forwarded)

    # -- page ------------------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        """The live progress page."""
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    # -- API -------------------------------------------------------------------------------

    async def list_tools(self, request: Request) -> Response:
        """``GET /v1/tools``; ``If-None-Match`` with the current hash answers 304."""
        known = request.headers.get("if-none-match", "").removeprefix("W/").strip('"')
        try:
            reply = await self.client.list_tools(self._metadata(request), known)
        except grpc.aio.AioRpcError as error:
            return rpc_error_response(error)
        # Kept by the browser only, and asked again each time (a 304 while unchanged).
        etag = {"ETag": f'"{reply.catalog_hash}"', "Cache-Control": "private, no-cache"}
        if reply.not_modified:
            return Response(status_code=304, headers=etag)
        return JSONResponse(json_format.MessageToDict(reply, preserving_proto_field_name=True),
                            headers=etag)

    async def capabilities(self, request: Request) -> Response:
        """``GET /v1/capabilities``: what the page may offer on this server."""
        return JSONResponse(_CAPABILITIES)

    async def list_runs(self, request: Request) -> Response:
        """``GET /v1/runs``: a page of ListRuns."""
        try:
            grpc_request = _list_runs_request(request)
        except _BadRequest as bad:
            return bad.response()
        try:
            reply = await self.client.list_runs(grpc_request, self._metadata(request))
        except grpc.aio.AioRpcError as error:
            return rpc_error_response(error)
        return JSONResponse(runs_json(reply))

    async def watch_runs(self, request: Request) -> Response:
        """``GET /v1/runs/events``: the first page of the list as a ``runs`` event, then
        again each time it changes, until the client goes away."""
        try:
            grpc_request = _list_runs_request(request)
        except _BadRequest as bad:
            return bad.response()
        metadata = self._metadata(request)
        try:  # a refused caller gets an HTTP error, not a stream
            first = await self.client.list_runs(grpc_request, metadata)
        except grpc.aio.AioRpcError as error:
            return rpc_error_response(error)

        return self._stream(request, self.runs_watch.follow(grpc_request, metadata, first))

    async def execute(self, request: Request) -> Response:
        """``POST /v1/tools/{name}:execute``."""
        try:
            body = ExecuteBody.model_validate(await self._json_body(request))
            grpc_request = self._execute_request(request, body)
        except _BadRequest as bad:
            return bad.response()
        except ValidationError as exc:
            return _validation_response(exc)
        wants_stream = "text/event-stream" in request.headers.get("accept", "")
        metadata = self._metadata(request)
        try:
            started = await self.client.start_run(grpc_request, metadata, listen=wants_stream)
        except grpc.aio.AioRpcError as error:
            return rpc_error_response(error)
        urls = {"run_id": started.run_id,
                "events_url": f"/v1/runs/{started.run_id}/events",
                "cancel_url": f"/v1/runs/{started.run_id}:cancel"}
        if wants_stream:
            return self._stream(request, QueueSource(started), started.run_id)
        if request.query_params.get("wait", "").lower() in ("1", "true", "yes"):
            try:
                final = await started.result
            except (grpc.aio.AioRpcError, RuntimeError) as exc:
                return http_error(502, "UNAVAILABLE", f"lost the run's stream ({exc}); "
                                  f"follow it at {urls['events_url']}")
            shown = event_json(final)
            return JSONResponse({**urls, "seq": shown.get("seq"), "result": shown["result"]})
        return JSONResponse(urls, status_code=202, headers={"Location": urls["events_url"]})

    async def events(self, request: Request) -> Response:
        """``GET /v1/runs/{run_id}/events``: Server-Sent Events."""
        try:
            after_seq = _after_seq(request)
        except _BadRequest as bad:
            return bad.response()
        call = self.client.watch(request.path_params["run_id"], after_seq,
                                 self._metadata(request))
        source = WatchSource(call)
        first = source.next_event()
        await asyncio.wait({first}, timeout=FIRST_EVENT_WAIT_SECONDS)
        if first.done():
            try:
                first.result()
            except grpc.aio.AioRpcError as error:
                source.close()
                if is_run_finished(error):
                    # Nothing after Last-Event-ID and the run is over (WatchRun's
                    # RUN_FINISHED): 204 tells an EventSource to stop reconnecting.
                    return Response(status_code=204)
                return rpc_error_response(error)
        # A stream cut before its Result (event None) ends this response at once, and the
        # EventSource reconnects with Last-Event-ID.
        return self._stream(request, source)

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/runs/{run_id}:cancel``: CancelRun; 200 ``{"cancelled": …}``."""

        async def send(body: CancelBody) -> dict[str, Any]:
            cancelled = await self.client.cancel(request.path_params["run_id"], body.reason,
                                                 self._metadata(request))
            return {"cancelled": cancelled}

        return await self._run_command(request, CancelBody, send)

    async def steer(self, request: Request) -> Response:
        """``POST /v1/runs/{run_id}:steer``: SteerRun; 200 ``{"run_id": …}``."""

        async def send(body: SteerBody) -> dict[str, Any]:
            run_id = await self.client.steer(request.path_params["run_id"], body.message,
                                             self._metadata(request))
            return {"run_id": run_id}

        return await self._run_command(request, SteerBody, send)

    async def approve(self, request: Request) -> Response:
        """``POST /v1/runs/{run_id}:approve``: ApproveRun; 200 ``{"run_id": …, "decision":
        …, "arguments_digest": …}``."""

        async def send(body: ApproveBody) -> dict[str, Any]:
            reply = await self.client.approve(tool_service_pb2.ApproveRunRequest(
                run_id=request.path_params["run_id"], approval_id=body.approval_id,
                reason=body.reason, arguments_digest=body.arguments_digest,
                decision=tool_service_pb2.APPROVAL_VERDICT_DENY if body.decision == "deny"
                else tool_service_pb2.APPROVAL_VERDICT_APPROVE), self._metadata(request))
            return {"run_id": reply.run_id, "decision": body.decision,
                    "arguments_digest": reply.arguments_digest}

        return await self._run_command(request, ApproveBody, send)
    async def create_session(self, request: Request) -> Response:
        """``POST /v1/sessions``: CreateSession; 200 with the session."""

        async def send(body: SessionBody) -> dict[str, Any]:
            reply = await self.client.stub.CreateSession(
                tool_service_pb2.CreateSessionRequest(**body.model_dump()),
                metadata=self._metadata(request))
            return _message_json(reply.session)

        return await self._run_command(request, SessionBody, send)

    async def list_sessions(self, request: Request) -> Response:
        """``GET /v1/sessions``: ListSessions; ``{"sessions": […]}`` (``?files=true``: with
        each session's files)."""
        try:
            with_files = request.query_params.get("files", "").lower() in ("1", "true", "yes")
            reply = await self.client.stub.ListSessions(
                tool_service_pb2.ListSessionsRequest(with_files=with_files),
                metadata=self._metadata(request))
        except grpc.aio.AioRpcError as error:
            return rpc_error_response(error)
        return JSONResponse({"sessions": [_message_json(s) for s in reply.sessions]})

    async def close_session(self, request: Request) -> Response:
        """``POST /v1/sessions/{session_id}:close``: CloseSession; ``{"session_id": …}``."""

        async def send(body: NoBody) -> dict[str, Any]:
            reply = await self.client.stub.CloseSession(
                tool_service_pb2.CloseSessionRequest(
                    session_id=request.path_params["session_id"]),
                metadata=self._metadata(request))
            return {"session_id": reply.session_id}

        return await self._run_command(request, NoBody, send)

    async def _run_command(self, request: Request, body_type: type[_Body],
                           send: Callable[[_Body], Awaitable[dict[str, Any]]]) -> Response:
        """A ``POST /v1/runs/{run_id}:…`` command: the JSON body checked as ``body_type``,
        then the unary call ``send`` makes; its refusal is the HTTP form of its status."""
        try:
            body = body_type.model_validate(await self._json_body(request))
        except _BadRequest as bad:
            return bad.response()
        except ValidationError as exc:
            return _validation_response(exc)
        try:
            return JSONResponse(await send(body))
        except grpc.aio.AioRpcError as error:
            return rpc_error_response(error)

    # -- request decoding ------------------------------------------------------------------

    async def _state_body(self, request: Request) -> Any:
        try:
            return await self._json_body(request)
        except _BadRequest as bad:
            raise BodyRefused(bad.response()) from None

    async def _json_body(self, request: Request) -> Any:
        raw = bytearray()
        vouched = False
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > self._max_body_bytes:
                    raise _BadRequest(f"the body is larger than {self._max_body_bytes} bytes",
                                      status=413)
                if not vouched and len(raw) > UNVOUCHED_BODY_BYTES:
                    await self._refuse_unknown_caller(request)
                    vouched = True
        except ClientDisconnect:
            # Gone before the end of its body (or cut off for sending it too slowly,
            # stargrpc.http_server): answered as a bad request, which nobody reads.
            raise _BadRequest("the body did not arrive whole") from None
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except RecursionError:
            raise _BadRequest("the body is nested too deeply",
                              [("body", "nested deeper than the JSON reader goes")]) from None
        except ValueError as exc:
            raise _BadRequest("the body is not valid JSON",
                              [("body", str(exc))]) from exc

    async def _refuse_unknown_caller(self, request: Request) -> None:
        """Raises :class:`_Unauthenticated` when the server refuses the request's
        credentials (asked with a ListTools of the caller's); any other answer, or none in
        time, lets the request go on (the call it becomes is checked anyway)."""
        try:
            async with asyncio.timeout(_CREDENTIALS_CHECK_SECONDS):
                await self.client.list_tools(self._metadata(request))
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.UNAUTHENTICATED:
                raise _Unauthenticated(error) from None
        except TimeoutError:
            pass

    @staticmethod
    def _execute_request(request: Request, body: ExecuteBody
                         ) -> tool_service_pb2.ExecuteRequest:
        message = tool_service_pb2.ExecuteRequest(
            tool_name=request.path_params["name"],
            arguments_json=json.dumps(body.arguments),
            idempotency_key=body.idempotency_key or request.headers.get("idempotency-key", ""),
            catalog_hash=body.catalog_hash, parent_run_id=body.parent_run_id,
            session_id=body.session_id, session_no_wait=body.session_no_wait, lane=body.lane,
            priority=body.priority, max_wait_seconds=body.max_wait_seconds)
        try:
            json_format.ParseDict(body.context, message.context)
        except json_format.ParseError as exc:
            raise _BadRequest("context is not a valid InvocationContext",
                              [("context", str(exc))]) from exc
        return message


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path, wrong method) in the gateway's error shape."""
    assert isinstance(exc, HTTPException)
    code = {404: "NOT_FOUND", 405: "UNIMPLEMENTED"}.get(
        exc.status_code, "INTERNAL" if exc.status_code >= 500 else "INVALID_ARGUMENT")
    response = http_error(exc.status_code, code, str(exc.detail))
    response.headers.update(exc.headers or {})
    return response


def _after_seq(request: Request) -> int:
    given = request.headers.get("last-event-id") or request.query_params.get("after_seq") or "0"
    try:
        after_seq = int(given)
    except ValueError:
        after_seq = -1
    if not 0 <= after_seq <= _MAX_SEQ:
        raise _BadRequest("Last-Event-ID / after_seq must be a seq (a whole number >= 0)",
                          [("Last-Event-ID", f"not a seq: {given[:40]!r}")])
    return after_seq


#: The largest seq (a uint64).
_MAX_SEQ = 2**64 - 1

#: How much of a request's body the gateway reads before it asks the server whether the
#: caller's credentials pass: a caller the server refuses makes the gateway hold no more
#: than this (rather than up to max_body_bytes) per connection.
UNVOUCHED_BODY_BYTES = 64 * 1024

#: Event streams (``…/events``, ``Accept: text/event-stream``) one caller may hold open at
#: once: each holds a call on the server, and each live run list a poll of its own.
MAX_STREAMS_PER_CALLER = 64

#: How long the credentials of a malformed request are checked for (see
#: Gateway._credentials_first).
_CREDENTIALS_CHECK_SECONDS = 5.0

#: What this gateway offers the page: its routes are fixed, so this is too.
_CAPABILITIES = {"steer": True, "cancel": True, "list_runs": True, "approve": True}


def _list_runs_request(request: Request) -> tool_service_pb2.ListRunsRequest:
    """The ListRuns request of ``GET /v1/runs?tool=&state=&outcome=&page_size=&page_token=
    &root_run_id=&parent_run_id=&lane=``.

    Raises:
        _BadRequest: A parameter is not valid.
    """
    params = request.query_params
    violations: list[tuple[str, str]] = []
    message = tool_service_pb2.ListRunsRequest(tool_name=params.get("tool", ""),
                                               page_token=params.get("page_token", ""),
                                               root_run_id=params.get("root_run_id", ""),
                                               parent_run_id=params.get("parent_run_id", ""),
                                               lane=params.get("lane", ""))
    state = params.get("state", "").upper().removeprefix("RUN_STATE_")
    if state:
        try:
            message.state = tool_service_pb2.RunState.Value(f"RUN_STATE_{state}")
        except ValueError:
            violations.append(("state", "one of running, queued, awaiting_approval, finished"))
    outcome = params.get("outcome", "").upper().removeprefix("OUTCOME_")
    if outcome:
        try:
            message.outcome = events_pb2.Outcome.Value(f"OUTCOME_{outcome}")
        except ValueError:
            violations.append(("outcome", "one of ok, denied, failed, error, timeout, "
                                          "cancelled"))
    size = params.get("page_size", "0")
    if size.isdigit() and len(size) <= 4:
        message.page_size = int(size)
    else:
        violations.append(("page_size", "a whole number from 0 to 200"))
    if violations:
        raise _BadRequest("the run list query is not valid", violations)
    return message


def _message_json(message: Any) -> dict[str, Any]:
    """A reply message as the JSON the HTTP API answers (proto field names)."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _validation_response(exc: ValidationError) -> JSONResponse:
    violations = [(".".join(str(p) for p in error["loc"]) or "body", error["msg"])
                  for error in exc.errors()]
    hint = ""
    if any(error["type"] == "extra_forbidden" for error in exc.errors()):
        hint = ' (the tool\'s arguments go under "arguments")'
    names = ", ".join(field for field, _ in violations[:5])
    return _BadRequest(f"the body is not a valid request: {names}{hint}",
                       violations).response()
