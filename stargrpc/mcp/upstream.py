"""MCP servers behind stargrpc (``mcp_servers``): their tools join the catalog as ordinary
stargrpc tools, so a call to one goes through authentication, permissions, audit, the
critic, limits and idempotency like any other.

Each entry of ``mcp_servers`` gets an :class:`Upstream`, which keeps one connection (the
official SDK's :class:`mcp.Client`) open in a task of its own: a stdio server is a
long-running process of the sandbox (:meth:`stargrpc.sandbox.Sandbox.spawn`), an HTTP one
is reached through the SSRF rules of ``http_fetch`` (:mod:`stargrpc.egress`). A server
that cannot be reached, crashes or stops answering pings is restarted (reconnected) with a
doubling backoff; meanwhile its tools stay listed, marked unavailable with the reason, and
a call fails with ``MCP_SERVER_UNAVAILABLE``. Every change of what a server offers changes
the catalog hash, so WatchCatalog tells clients; nothing waits on a slow server.

What a server lists is bounded before it joins the catalog, so one server cannot break the
catalog for every client: at most :data:`MAX_TOOLS_PER_SERVER` tools, descriptions trimmed
to :data:`MAX_DESCRIPTION_CHARS`, schemas vetted by :mod:`stargrpc.mcp.schemas` (a tool
whose input schema is unusable stays listed, unavailable with the reason), and the whole
catalog, local tools included, kept under :data:`CATALOG_MAX_BYTES` — under the 4 MiB a
gRPC client accepts by default.

During a call: MCP progress notifications become heartbeats (with progress when the server
gives a total; a flood of them is thinned out, see :class:`_Progress`), MCP log messages
become deltas (when the call is the only one in flight on that connection: a log message
names no request), and the MCP result becomes the Result (text content → output,
``structuredContent`` → structured output, images, audio and embedded resources → sent
files, ``isError`` → FAILED). Cancelling the run (CancelRun, the critic's deadline, the
caller leaving) cancels the request, which sends ``notifications/cancelled`` to the server.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import json
import mimetypes
import re
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import httpx2
import mcp_types as types
import structlog
from mcp import Client
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types.jsonrpc import CONNECTION_CLOSED, REQUEST_TIMEOUT
from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator
from pydantic_core import PydanticCustomError

from stargrpc.egress import HttpPolicy, Refused, canonical_host, vet_url
from stargrpc.errors import ToolFailed
from stargrpc.mcp.schemas import ArgumentChecker, SchemaTooCostly, schema_problem
from stargrpc.registry import Registry, ToolAnnotations, ToolSpec
from stargrpc.runs.context import ToolContext
from stargrpc.runs.outcome import Outcome, ToolResult
from stargrpc.sandbox.policy import decide
from stargrpc.sandbox.runner import Sandbox, SandboxProcess
from stargrpc.server.service import tool_message
from stargrpc.settings import McpServerEntry, Settings

log = structlog.get_logger("stargrpc.mcp.upstream")

#: Seconds between two pings of an idle connection (a dead HTTP server is noticed so).
PING_SECONDS = 5.0
#: The first wait before a restart; it doubles up to ``mcp_servers_restart_max_seconds``.
FIRST_BACKOFF_SECONDS = 0.1
#: A connection that lived this long resets the backoff.
STABLE_SECONDS = 10.0
#: Largest line a stdio server may send (one JSON-RPC message).
MAX_LINE_BYTES = 16 * 1024 * 1024
#: Most tools one server adds to the catalog; the rest of its list is left out (logged).
MAX_TOOLS_PER_SERVER = 256
#: Longest description of an upstream tool; a longer one is trimmed (logged).
MAX_DESCRIPTION_CHARS = 8 * 1024
#: Largest catalog: every tool's entry as ListTools and WatchCatalog send it, local tools
#: first. An upstream tool that would pass it is left out (logged). The rest of gRPC's
#: default 4 MiB receive limit covers what each caller's copy adds (its permissions).
CATALOG_MAX_BYTES = 3 * 1024 * 1024
#: Progress notifications of one call passed on as heartbeats as they come; after these,
#: one per PROGRESS_INTERVAL_SECONDS, the latest (see :class:`_Progress`).
PROGRESS_BURST = 32
PROGRESS_INTERVAL_SECONDS = 0.5
#: Bytes of a server's log notifications one call passes on as its ``log`` output; past
#: them the rest are counted, not kept (a notice says how many): a server logging without
#: end would otherwise grow the run's log, and the server's memory, until the call ends.
MAX_LOG_BYTES_PER_CALL = 1024 * 1024
#: Shortest time between two listings of a server's tools on its ``list_changed``
#: notifications (those that come meanwhile make one listing).
RELIST_INTERVAL_SECONDS = 1.0

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# What each tool's entry in a ListTools response adds to its message: its tag and length.
_ENTRY_FRAMING_BYTES = 6


class UpstreamArguments(BaseModel):
    """Base of the argument model of an upstream tool: its JSON Schema is the one the MCP
    server declares, and arguments are checked against it (precisely, by path) before the
    server is contacted."""

    model_config = ConfigDict(extra="allow")
    upstream_schema: ClassVar[dict[str, Any]] = {}
    checker: ClassVar[ArgumentChecker | None] = None

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The upstream tool's own schema."""
        return copy.deepcopy(cls.upstream_schema)

    @model_validator(mode="before")
    @classmethod
    def _check_schema(cls, value: Any) -> Any:
        checker = cls.checker
        if checker is None:  # an output schema, or an unavailable tool's stand-in
            return value
        try:
            found = checker.mismatches(value)
        except SchemaTooCostly as exc:
            raise _violations(value, [((), f"too costly to check against the tool's input "
                                           f"schema ({exc})")]) from None
        except Exception as exc:  # a schema the validator still cannot apply: refuse, said
            raise _violations(value, [((), f"the tool's input schema cannot check them "
                                           f"({_describe(exc)})")]) from None
        if found:
            # Each at its path (``arguments.a``), as a local tool's model names its fields.
            raise _violations(value, [(m.path, m.message) for m in found])
        return value


def _violations(value: Any, found: list[tuple[tuple[str | int, ...], str]]
                ) -> ValidationError:
    """Mismatches as pydantic's errors at their own locations: raised in a validator, they
    keep them, and the run's argument check names each field."""
    return ValidationError.from_exception_data("arguments", [
        {"type": PydanticCustomError("upstream_schema", "{reason}", {"reason": message}),
         "loc": path, "input": value} for path, message in found])


def _schema_model(name: str, schema: dict[str, Any] | None,
                  checker: ArgumentChecker | None = None) -> type[UpstreamArguments]:
    model = create_model(f"Upstream_{re.sub(r'[^A-Za-z0-9_]', '_', name)}",
                         __base__=UpstreamArguments)
    model.upstream_schema = schema or {"type": "object"}
    model.checker = checker
    return model


@dataclass(frozen=True)
class _Listed:
    """A tool a server listed, as it joins the catalog.

    Attributes:
        tool: As the server listed it.
        name: Its stargrpc name (the prefix, then its own).
        description: Trimmed to MAX_DESCRIPTION_CHARS.
        problem: Why it cannot be called (its input schema); empty when it can.
        checker: Checks its arguments; None when it cannot be called.
        output_schema: Its output schema, when it declares a usable one.
    """

    tool: types.Tool
    name: str
    description: str
    problem: str
    checker: ArgumentChecker | None
    output_schema: dict[str, Any] | None


class Upstream:
    """One MCP server of ``mcp_servers``: its connection, its tools and its availability.

    Attributes:
        entry: Its settings entry.
        tools: The tools it listed last (kept while it is unavailable).
        reason: Why it is unavailable; empty while it is connected.
    """

    entry: McpServerEntry
    tools: tuple[types.Tool, ...]
    reason: str
    _settings: Settings
    _on_change: Callable[[], None]
    _client: Client | None
    _process: SandboxProcess | None
    _calls: list[_Progress]
    _lost: asyncio.Event
    _task: asyncio.Task[None] | None
    _listed: list[_Listed]
    _checked: dict[str, tuple[str, ArgumentChecker | None]]
    _specs: list[ToolSpec]
    _relist_wanted: bool
    _relisting: bool

    def __init__(self, entry: McpServerEntry, settings: Settings,
                 on_change: Callable[[], None]) -> None:
        self.entry = entry
        self.tools = ()
        self.reason = "not connected yet"
        self._settings = settings
        self._on_change = on_change
        self._client = None
        self._process = None
        self._calls = []
        self._lost = asyncio.Event()
        self._task = None
        self._listed = []
        self._checked = {}
        self._specs = []
        self._relist_wanted = False
        self._relisting = False

    @property
    def available(self) -> bool:
        """Whether calls reach the server now."""
        return self._client is not None

    def start(self) -> None:
        """Starts connecting (and reconnecting) in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"mcp-{self.entry.name}")

    async def aclose(self) -> None:
        """Closes the connection (a stdio server's process group is killed)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=10)

    def specs(self) -> list[ToolSpec]:
        """Its tools as stargrpc tools (unavailable ones say so in their description)."""
        return list(self._specs)

    # -- the connection --------------------------------------------------------------------

    async def _supervise(self) -> None:
        delay = FIRST_BACKOFF_SECONDS
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            attempt = asyncio.create_task(self._session())
            timer = loop.call_later(self.entry.connect_timeout_seconds, self._give_up, attempt)
            try:
                reason = await attempt
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():  # closing, not a timeout
                    attempt.cancel()
                    await asyncio.wait([attempt], timeout=10)
                    raise
                reason = (f"no answer within {self.entry.connect_timeout_seconds:g} s "
                          "(connect_timeout_seconds)")
            except Exception as exc:  # whatever broke, the server is unavailable
                reason = _describe(exc)
            finally:
                timer.cancel()
            self._set_unavailable(reason)
            if loop.time() - started > STABLE_SECONDS:
                delay = FIRST_BACKOFF_SECONDS
            log.warning("mcp_server_unavailable", server=self.entry.name, reason=reason,
                        retry_in_seconds=round(delay, 2))
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._settings.mcp_servers_restart_max_seconds)

    def _give_up(self, attempt: asyncio.Task[str]) -> None:
        if self._client is None:  # still connecting: a slow server must not hang forever
            attempt.cancel()

    async def _session(self) -> str:
        """Connects, lists the tools, serves calls until the connection is lost; returns why
        it was lost."""
        async with AsyncExitStack() as stack:
            transport, ended = await self._transport(stack)
            client = await stack.enter_async_context(Client(
                transport, logging_callback=self._on_log, message_handler=self._on_message,
                log_level="debug", cache=None))
            await self._set_tools(await _list_all(client))
            self._lost = asyncio.Event()
            self._client = client
            self._announce()
            log.info("mcp_server_connected", server=self.entry.name, tools=len(self.tools))
            try:
                return await self._until_lost(client, ended)
            finally:
                self._client = None

    async def _until_lost(self, client: Client, ended: asyncio.Future[str] | None) -> str:
        lost = asyncio.ensure_future(self._lost.wait())
        waiting: set[asyncio.Future[Any]] = {lost} | ({ended} if ended is not None else set())
        try:
            while True:
                await asyncio.wait(waiting, timeout=PING_SECONDS,
                                   return_when=asyncio.FIRST_COMPLETED)
                if ended is not None and ended.done():
                    return ended.result()
                if lost.done():
                    return "the connection was lost"
                if self._calls:
                    continue  # a call in flight keeps the connection busy enough
                try:
                    with anyio.fail_after(self.entry.connect_timeout_seconds):
                        await client.session.send_ping()
                except MCPError as exc:
                    # An error is an answer: a 2026-07-28 server answers ping with "Method
                    # not found", and it is there all the same.
                    if exc.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):
                        return f"it stopped answering pings: {_describe(exc)}"
                except Exception as exc:
                    return f"it stopped answering pings: {_describe(exc)}"
        finally:
            lost.cancel()

    async def _transport(self, stack: AsyncExitStack
                         ) -> tuple[Any, asyncio.Future[str] | None]:
        """The transport to hand the SDK's Client, and (stdio) a future done with a
        description once the process has exited."""
        entry = self.entry
        if entry.command is not None:
            policy = await asyncio.to_thread(decide, self._settings)
            if policy.refusal is not None:
                raise _Unavailable(policy.refusal)
            sandbox = Sandbox(self._settings)
            env = {k: v.get_secret_value() for k, v in entry.env.items()}
            process = await sandbox.spawn([entry.command, *entry.args], env=env,
                                          read_only_paths=entry.read_only_paths,
                                          on_stderr=self._on_stderr)
            self._process = process
            stack.push_async_callback(process.aclose)
            ended = asyncio.get_running_loop().create_future()
            process.exited.add_done_callback(lambda _: _exited(process, ended))
            return _process_streams(process), ended
        assert entry.url is not None
        url, headers = await self._vetted(entry.url)
        # Bodies come uncompressed and a JSON one bounded (:class:`_BoundedBodies`).
        http = await stack.enter_async_context(httpx2.AsyncClient(
            headers={**headers, "Accept-Encoding": "identity"},
            timeout=httpx2.Timeout(entry.connect_timeout_seconds, read=None),
            transport=_BoundedBodies(httpx2.AsyncHTTPTransport())))
        return streamable_http_client(url, http_client=http), None

    async def _vetted(self, url: str) -> tuple[str, dict[str, str]]:
        """The URL to connect to and the headers to send: the host is checked with the
        rules of http_fetch (its addresses after DNS; private, loopback and link-local
        ones only inside ``mcp_servers_allowed_networks``) and, over plain http, the
        connection is pinned to the vetted address."""
        headers = {k: v.get_secret_value() for k, v in self.entry.headers.items()}
        host = httpx2.URL(url).host
        policy = HttpPolicy((canonical_host(host),) if host else (),
                            HttpPolicy.from_settings(self._settings.model_copy(update={
                                "http_fetch_allowed_networks":
                                    self._settings.mcp_servers_allowed_networks,
                            })).allowed_networks)
        try:
            target = await vet_url(url, policy)
        except Refused as exc:
            raise _Unavailable(f"{exc} ({exc.code}; see mcp_servers_allowed_networks)") \
                from exc
        if target.url.scheme == "https":
            return url, headers  # the certificate is checked against the name
        return str(target.request_url), {**headers, "Host": target.host_header}

    # -- what the server says --------------------------------------------------------------

    async def _set_tools(self, listed: list[types.Tool]) -> None:
        if len(listed) > MAX_TOOLS_PER_SERVER:
            log.error("mcp_tools_left_out", server=self.entry.name, listed=len(listed),
                      kept=MAX_TOOLS_PER_SERVER,
                      reason=f"a server adds at most {MAX_TOOLS_PER_SERVER} tools")
            listed = listed[:MAX_TOOLS_PER_SERVER]
        # Walking and sizing 256 schemas of up to 64 KiB is work for a thread, not for the
        # event loop; a schema seen in the last listing is not vetted again.
        checked: dict[str, tuple[str, ArgumentChecker | None]] = {}
        vetted = await asyncio.to_thread(
            lambda: [v for tool in listed if (v := self._vet(tool, checked)) is not None])
        self.tools = tuple(listed)
        self._listed = vetted
        self._checked = checked

    def _vet(self, tool: types.Tool, checked: dict[str, tuple[str, ArgumentChecker | None]]
             ) -> _Listed | None:
        """``tool`` bounded for the catalog; None when its name cannot be a stargrpc one.
        ``checked`` gathers the verdict on each input schema (by its JSON)."""
        server = self.entry.name
        name = self.entry.tool_prefix + tool.name
        if not _TOOL_NAME.fullmatch(name):
            log.error("mcp_tool_skipped", server=server, tool=tool.name[:100],
                      reason="not a valid stargrpc tool name (1-64 of letters, digits, _-.)")
            return None
        description = (tool.description or tool.title or "").strip()
        if len(description) > MAX_DESCRIPTION_CHARS:
            log.warning("mcp_tool_description_trimmed", server=server, tool=tool.name,
                        chars=len(description), limit=MAX_DESCRIPTION_CHARS)
            description = description[:MAX_DESCRIPTION_CHARS - 1] + "…"
        schema = tool.input_schema or {"type": "object"}
        problem, checker = self._verdict(schema, checked)
        if problem:
            log.error("mcp_tool_unavailable", server=server, tool=tool.name, reason=problem)
        output = tool.output_schema
        output_problem = self._verdict(output, checked, "output schema")[0] if output else ""
        if output_problem:
            log.warning("mcp_tool_output_schema_left_out", server=server, tool=tool.name,
                        reason=output_problem)
            output = None
        return _Listed(tool, name, description, problem, checker, output)

    def _verdict(self, schema: dict[str, Any],
                 checked: dict[str, tuple[str, ArgumentChecker | None]],
                 what: str = "input schema") -> tuple[str, ArgumentChecker | None]:
        """Why ``schema`` cannot check values (empty when it can), and its checker."""
        try:
            key = what + json.dumps(schema, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            key = ""
        verdict = self._checked.get(key) if key else None
        if verdict is None:
            try:
                problem = schema_problem(schema, what) or ""
                verdict = (problem, None if problem else ArgumentChecker(schema))
            except Exception as exc:  # whatever the schema broke, it cannot be used
                verdict = (f"its {what} cannot be used: {_describe(exc)}", None)
        if key:
            checked[key] = verdict
        return verdict

    def _set_unavailable(self, reason: str) -> None:
        was = self.reason
        self.reason = reason or "unavailable"
        self._client = None
        # Only a change between available and not changes the catalog: a retry that fails
        # for a slightly different reason does not make every client reload.
        if not was and self.tools:
            self._announce()

    def _announce(self) -> None:
        if self._client is not None:
            self.reason = ""
        self._specs = [self._spec(listed) for listed in self._listed]
        self._on_change()

    async def _on_message(self, message: Any) -> None:
        if not isinstance(message, types.ToolListChangedNotification):
            return
        # The SDK hands each notification to a task of its own: one list at a time, and
        # the notifications that come meanwhile make one more, at most one per
        # RELIST_INTERVAL_SECONDS. A server sending thousands of them had stargrpc list and
        # vet its tools thousands of times at once (the event loop slowed for minutes).
        self._relist_wanted = True
        if self._relisting:
            return
        self._relisting = True
        try:
            while self._relist_wanted and (client := self._client) is not None:
                self._relist_wanted = False
                started = asyncio.get_running_loop().time()
                try:
                    await self._set_tools(await _list_all(client))
                except Exception as exc:
                    log.warning("mcp_tools_relist_failed", server=self.entry.name,
                                error=_describe(exc))
                    return
                if self._client is client:
                    self._announce()
                await asyncio.sleep(max(0.0, started + RELIST_INTERVAL_SECONDS
                                        - asyncio.get_running_loop().time()))
        finally:
            self._relisting = False

    async def _on_log(self, params: types.LoggingMessageNotificationParams) -> None:
        data = params.data if isinstance(params.data, str) else json.dumps(
            params.data, ensure_ascii=False, default=str)
        if len(self._calls) == 1:
            await self._calls[0].log(f"[{params.level}] {data}\n")
        else:  # no request is named: with several calls in flight, it belongs to none
            log.info("mcp_server_log", server=self.entry.name, level=params.level,
                     logger=params.logger, data=data[:2000])

    async def _on_stderr(self, channel: str, text: str) -> None:
        log.info("mcp_server_stderr", server=self.entry.name, text=text[:2000])

    # -- tools -----------------------------------------------------------------------------

    def _spec(self, listed: _Listed) -> ToolSpec:
        entry = self.entry
        tool, name, problem = listed.tool, listed.name, listed.problem
        hints = tool.annotations or types.ToolAnnotations()
        reason = problem or self.reason
        description = (f"[unavailable: {reason}] {listed.description}" if reason
                       else listed.description)
        upstream_name = tool.name

        async def call(ctx: ToolContext, args: BaseModel) -> ToolResult:
            if problem:
                raise ToolFailed(f"the tool {upstream_name!r} of the MCP server "
                                 f"{entry.name!r} is unavailable: {problem}",
                                 code="MCP_TOOL_UNAVAILABLE")
            return await self.call(ctx, upstream_name, dict(args.model_extra or {}))

        output_model = (_schema_model(name + "_output", listed.output_schema)
                        if listed.output_schema else None)
        # An unusable schema is not shown: the tool takes any object and says why it fails.
        args_model = _schema_model(name, None if problem else tool.input_schema,
                                   listed.checker)
        return ToolSpec(
            name=name, description=description, fn=call,
            args_model=args_model, output_model=output_model,
            kind="mcp", categories=("mcp", entry.name),
            # MCP's defaults: a tool that does not say it is read-only, nor that its
            # updates are only additive, may destroy (destructiveHint defaults to true), and
            # is so for approval_policy's ``destructive``.
            annotations=ToolAnnotations(
                read_only=bool(hints.read_only_hint),
                destructive=not hints.read_only_hint and hints.destructive_hint is not False,
                idempotent=bool(hints.idempotent_hint),
                open_world=hints.open_world_hint is not False),
            privileged=entry.privileged, allowed_roles=tuple(entry.roles),
            allowed_principals=tuple(entry.principals),
            soft_timeout=entry.soft_timeout_seconds, source=f"mcp_servers[{entry.name}]")

    async def call(self, ctx: ToolContext, tool_name: str, arguments: dict[str, Any]
                   ) -> ToolResult:
        """Calls ``tool_name`` on the server for the run of ``ctx``.

        Raises:
            ToolFailed: The server is unavailable (``MCP_SERVER_UNAVAILABLE``), went away
                during the call (``MCP_SERVER_DIED``) or answered with a protocol error
                (``MCP_ERROR``).
        """
        client = self._client
        name = self.entry.name
        if client is None:
            raise ToolFailed(f"the MCP server {name!r} is unavailable: {self.reason}",
                             code="MCP_SERVER_UNAVAILABLE")

        progress = _Progress(ctx)
        self._calls.append(progress)
        # The receipt counts the call's own messages (the connection is shared by every
        # call, so its wire bytes are nobody's alone): the request's parameters now, the
        # result when it comes.
        ctx.usage.add_network(sent=len(json.dumps(
            {"name": tool_name, "arguments": arguments}, separators=(",", ":"),
            ensure_ascii=False, default=str).encode()))
        try:
            result = await client.session.call_tool(
                tool_name, arguments, read_timeout_seconds=self.entry.call_timeout_seconds,
                progress_callback=progress.on_progress)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                return ToolResult(outcome=Outcome.TIMEOUT, error_code="MCP_CALL_TIMEOUT",
                                  error_message=f"the MCP server {name!r} did not answer "
                                  f"within {self.entry.call_timeout_seconds:g} s")
            if exc.code == CONNECTION_CLOSED or self._client is not client:
                raise self._died(client) from exc
            raise ToolFailed(f"the MCP server {name!r} answered with an error: "
                             f"{exc.message[:500]}", code="MCP_ERROR") from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, httpx2.HTTPError,
                OSError) as exc:
            raise self._died(client) from exc
        finally:
            self._calls.remove(progress)
        ctx.usage.add_network(received=len(result.model_dump_json(
            by_alias=True, exclude_none=True).encode()))
        await progress.finish(name)
        return _result(ctx, result)

    def _died(self, client: Client) -> ToolFailed:
        self._lost.set()
        why = self.reason if self._client is not client and self.reason else \
            "the connection was closed"
        return ToolFailed(f"the MCP server {self.entry.name!r} went away during the call: "
                          f"{why}", code="MCP_SERVER_DIED")


class _Progress:
    """One call's progress notifications as heartbeats of its run, thinned out so that a
    server sending thousands cannot grow the run log (and the server's memory) with them.

    A token bucket: the first PROGRESS_BURST pass as they come (a tool reporting a few
    steps shows each), then one per PROGRESS_INTERVAL_SECONDS. A notification arriving
    before its turn waits as the latest, and a later one replaces it; the latest still
    waiting when the call ends is passed on then, with a notice saying how many were
    replaced. The run log holds at most PROGRESS_BURST + 1 + (duration / interval)
    heartbeats from a call, however many the server sends. Its log notifications, likewise,
    at most :data:`MAX_LOG_BYTES_PER_CALL` bytes (:meth:`log`).
    """

    received: int
    passed: int
    logged_bytes: int
    unlogged: int
    ctx: ToolContext
    _tokens: float
    _refilled: float
    _latest: tuple[str, float | None] | None

    def __init__(self, ctx: ToolContext) -> None:
        self.received = 0
        self.passed = 0
        self.logged_bytes = 0
        self.unlogged = 0
        self.ctx = ctx
        self._tokens = float(PROGRESS_BURST)
        self._refilled = asyncio.get_running_loop().time()
        self._latest = None

    async def on_progress(self, progress: float, total: float | None,
                          message: str | None) -> None:
        """The SDK's progress callback."""
        self.received += 1
        shown = message or (f"{progress:g} of {total:g}" if total else f"{progress:g}")
        self._latest = (shown, min(max(progress / total, 0.0), 1.0) if total else None)
        now = asyncio.get_running_loop().time()
        self._tokens = min(float(PROGRESS_BURST),
                           self._tokens + (now - self._refilled) / PROGRESS_INTERVAL_SECONDS)
        self._refilled = now
        if self._tokens >= 1:
            self._tokens -= 1
            await self._pass_latest()

    async def log(self, text: str) -> None:
        """A log notification of the server's, as the call's ``log`` output while the call
        has logged less than :data:`MAX_LOG_BYTES_PER_CALL`; counted after that."""
        size = len(text.encode(errors="replace"))
        if self.unlogged or self.logged_bytes + size > MAX_LOG_BYTES_PER_CALL:
            self.unlogged += 1
            return
        self.logged_bytes += size
        await self.ctx.delta(text, channel="log")

    async def finish(self, server: str) -> None:
        """Passes on the latest notification still waiting, and says how many were
        replaced before their turn, and how many log notifications were not kept."""
        if self.unlogged:
            await self.ctx.notice(
                "MCP_LOG_TRUNCATED",
                f"the MCP server {server!r} logged more than {MAX_LOG_BYTES_PER_CALL} bytes "
                f"during the call: the {self.unlogged} notifications after them were not kept")
        if self._latest is not None:
            await self._pass_latest()
        replaced = self.received - self.passed
        if replaced:
            await self.ctx.notice(
                "MCP_PROGRESS_COALESCED",
                f"the MCP server {server!r} sent {self.received} progress notifications: "
                f"{self.passed} became heartbeats, {replaced} were replaced by later ones "
                f"(after the first {PROGRESS_BURST}, one per "
                f"{PROGRESS_INTERVAL_SECONDS:g} s)")

    async def _pass_latest(self) -> None:
        assert self._latest is not None
        shown, fraction = self._latest
        self._latest = None
        self.passed += 1
        await self.ctx.heartbeat(shown, progress=fraction)


class _BodyRefused(httpx2.StreamError):
    """A response body of an HTTP server that is not read: compressed though none was
    asked for, or a JSON one over :data:`MAX_LINE_BYTES`. The SDK answers the request it
    belonged to with an error saying so; the connection stays."""


class _BoundedBodies(httpx2.AsyncBaseTransport):
    """The HTTP transport to an MCP server, with its bodies bounded: the SDK reads a JSON
    response whole (and httpx inflates a compressed chunk whole), so a few megabytes of
    gzip from a hostile server became gigabytes in stargrpc's memory. A compressed body is
    refused (stargrpc sends ``Accept-Encoding: identity``), a JSON one (one message) is cut
    at :data:`MAX_LINE_BYTES` as a stdio server's line is; an event stream is left whole
    (the SDK bounds each event)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        codings = [c.strip().lower() for c in response.headers.get_list(
            "content-encoding", split_commas=True) if c.strip().lower() not in ("", "identity")]
        event_stream = response.headers.get("content-type", "").lower().startswith(
            "text/event-stream")
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        response.stream = _BoundedStream(response.stream, codings,
                                         None if event_stream else MAX_LINE_BYTES)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, codings: list[str],
                 cap: int | None) -> None:
        self._inner = inner
        self._codings = codings
        self._cap = cap

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._codings:
            raise _BodyRefused(f"the server sent a compressed body (Content-Encoding: "
                               f"{', '.join(self._codings)[:100]}) although stargrpc asks "
                               "for none (Accept-Encoding: identity)")
        received = 0
        async for chunk in self._inner:
            received += len(chunk)
            if self._cap is not None and received > self._cap:
                raise _BodyRefused(f"the server's JSON response is over {self._cap} bytes "
                                   "(MAX_LINE_BYTES)")
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Unavailable(Exception):
    """A reason the server cannot be started or reached, said as it is."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _Unavailable):
        return str(exc)
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in exc.exceptions[:3])
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


def _exited(process: SandboxProcess, ended: asyncio.Future[str]) -> None:
    if not ended.done():
        ended.set_result(f"the server process ended: {process.describe_exit()}")


async def _list_all(client: Client) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(100):  # pages; bounded against a server that never stops paging
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await client.session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor or len(tools) > MAX_TOOLS_PER_SERVER:  # past the cap: enough to say
            break
    return tools


@asynccontextmanager
async def _process_streams(process: SandboxProcess) -> AsyncIterator[TransportStreams]:
    """The SDK's stdio framing (one JSON-RPC message a line) over a sandboxed process's
    pipes; the SDK's own ``stdio_client`` starts its process itself, outside the sandbox."""
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def reader() -> None:
        async with read_writer:
            while True:
                try:
                    line = await process.stdout.readline()
                except (ValueError, OSError):  # a line over the limit, or the pipe broke
                    return
                if not line:
                    return
                if not line.strip():
                    continue
                try:
                    message: SessionMessage | Exception = SessionMessage(
                        types.jsonrpc_message_adapter.validate_json(line, by_name=False))
                except ValueError as exc:
                    message = exc
                try:
                    await read_writer.send(message)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return

    async def writer() -> None:
        try:
            async with write_reader:
                async for message in write_reader:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    process.stdin.write(data.encode() + b"\n")
                    await process.stdin.drain()
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await read_writer.aclose()  # the session sees the end instead of hanging

    async with anyio.create_task_group() as group:
        group.start_soon(reader)
        group.start_soon(writer)
        try:
            yield read_stream, write_stream
        finally:
            group.cancel_scope.cancel()


def _result(ctx: ToolContext, result: types.CallToolResult) -> ToolResult:
    """The Result of an MCP tool result: text → output, structured content → structured
    output, images, audio and embedded resources → sent files, isError → FAILED."""
    texts: list[str] = []
    for index, block in enumerate(result.content, 1):
        if isinstance(block, types.TextContent):
            texts.append(block.text)
        elif isinstance(block, types.ImageContent | types.AudioContent):
            kind = "image" if isinstance(block, types.ImageContent) else "audio"
            extension = mimetypes.guess_extension(block.mime_type) or ""
            _send(ctx, f"{kind}-{index}{extension}", block.data, block.mime_type, texts)
        elif isinstance(block, types.EmbeddedResource):
            resource = block.resource
            name = str(resource.uri).rstrip("/").rsplit("/", 1)[-1] or f"resource-{index}"
            if isinstance(resource, types.TextResourceContents):
                ctx.send_file(name, resource.text.encode(), resource.mime_type)
            else:
                _send(ctx, name, resource.blob, resource.mime_type, texts)
        elif isinstance(block, types.ResourceLink):
            texts.append(f"[resource: {block.uri}]")
    output = "\n".join(texts)
    structured = result.structured_content
    if result.is_error:
        return ToolResult(output=output, outcome=Outcome.FAILED, structured=structured,
                          error_code="TOOL_FAILED",
                          error_message=output[:500] or "the MCP tool reported an error")
    return ToolResult(output=output, structured=structured)


def _send(ctx: ToolContext, name: str, data: str, mime_type: str | None,
          texts: list[str]) -> None:
    try:
        content = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        texts.append(f"[{name}: not valid base64; dropped]")
        return
    ctx.send_file(name, content, mime_type)


class Upstreams:
    """Every MCP server of ``mcp_servers``, and the catalog they add to the local tools."""

    servers: list[Upstream]

    def __init__(self, settings: Settings, on_change: Callable[[], None]) -> None:
        self.servers = [Upstream(entry, settings, on_change) for entry in settings.mcp_servers]

    def start(self) -> None:
        """Starts connecting to each server in the background."""
        for server in self.servers:
            server.start()

    async def aclose(self) -> None:
        """Closes every connection."""
        await asyncio.gather(*(server.aclose() for server in self.servers))

    def catalog(self, local: Registry) -> Registry:
        """``local`` with the upstream tools; one whose name a local tool (or an earlier
        server) already has is left out and logged, never a reason to refuse the rest.

        The catalog stays under :data:`CATALOG_MAX_BYTES`: when the upstream tools do not
        all fit beside the local ones, the largest are left out (logged), so that one
        server's outsized entries cost themselves rather than many ordinary tools."""
        specs = list(local.values())
        taken = set(local)
        room = CATALOG_MAX_BYTES - sum(_entry_bytes(spec) for spec in specs)
        if room < 0:
            log.error("catalog_over_limit", bytes=CATALOG_MAX_BYTES - room,
                      limit=CATALOG_MAX_BYTES, reason="the local tools alone pass it")
        candidates: list[tuple[int, int, ToolSpec]] = []
        for order, spec in enumerate(_chain(server.specs() for server in self.servers)):
            if spec.name in taken:
                log.error("mcp_tool_name_taken", tool=spec.name, source=spec.source)
                continue
            taken.add(spec.name)
            candidates.append((_entry_bytes(spec), order, spec))
        for size, _, spec in sorted(candidates, key=lambda c: c[:2]):
            if size > room:
                log.error("mcp_tool_left_out", tool=spec.name, source=spec.source,
                          bytes=size, reason=f"the catalog would pass {CATALOG_MAX_BYTES} "
                          "bytes (CATALOG_MAX_BYTES); the largest tools are left out")
                continue
            room -= size
            specs.append(spec)
        return Registry(specs)


def _entry_bytes(spec: ToolSpec) -> int:
    """What ``spec`` adds to a ListTools response."""
    return tool_message(spec).ByteSize() + _ENTRY_FRAMING_BYTES


def _chain(lists: Iterable[list[ToolSpec]]) -> Iterable[ToolSpec]:
    for specs in lists:
        yield from specs
