"""The harness behind :mod:`stargrpc.testing`, which re-exports its public names."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from pydantic import BaseModel

from stargrpc.audit.view import AuditLimits, AuditView
from stargrpc.auth.authenticator import LocalPrincipal
from stargrpc.auth.keys import KeyStore
from stargrpc.client._files import StreamedFiles
from stargrpc.client.aio import AsyncClient
from stargrpc.client.events import (
    Heartbeat,
    InjectedTool,
    Notice,
    RichMessage,
    SentFile,
    Step,
    event_from_proto,
)
from stargrpc.errors import ToolDefinitionError
from stargrpc.principal import Principal
from stargrpc.registry import Registry, ToolSpec, import_tool_module, spec_of
from stargrpc.runs.outcome import Outcome
from stargrpc.runs.run import Run
from stargrpc.runs.runtime import RunRequest
from stargrpc.server.grpc_server import StargrpcServer, build_runtime
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2

__all__ = [
    "TEST_PRINCIPAL", "RecordedRun", "ServedTools", "StepNode", "load_tool_module", "record",
    "run_tool", "run_tool_sync", "serve", "serve_tools",
]

#: The principal tools see in the harness unless the test gives another: like the caller of
#: a server with authentication off, it holds every role (privileged tools included).
TEST_PRINCIPAL = LocalPrincipal(id="test", roles=frozenset({"*"}), method="test")


@dataclass
class StepNode:
    """One step of a run with the steps nested in it, as a tree.

    Attributes:
        step: The step as it ended (or as it started, if it never ended).
        children: The steps started inside it, in order.
        deltas: Its streamed output, concatenated.
    """

    step: Step
    children: list[StepNode] = field(default_factory=list)
    deltas: str = ""

    @property
    def title(self) -> str:
        """The step's title."""
        return self.step.title

    @property
    def status(self) -> str:
        """``"RUNNING"``, ``"COMPLETE"`` or ``"ERROR"``."""
        return self.step.status

    def walk(self) -> list[StepNode]:
        """This step and every step below it, depth first."""
        return [self, *(node for child in self.children for node in child.walk())]

    def find(self, title: str) -> StepNode:
        """The first step (depth first) titled ``title``.

        Raises:
            KeyError: No step has that title.
        """
        for node in self.walk():
            if node.title == title:
                return node
        raise KeyError(title)

    def outline(self) -> list[Any]:
        """The tree as nested ``[title, [children…]]`` lists, handy in an assertion."""
        return [self.title, [child.outline() for child in self.children]]


@dataclass(frozen=True)
class RecordedRun:
    """Everything one run emitted.

    Attributes:
        events: Every event, in order (the last is the Result).
        result: The Result message.
        audit: What the audit record of the run shows (``run_tool`` only; None for a run
            recorded from a server's stream, whose audit is in the server's store).
    """

    events: list[events_pb2.RunEvent]
    result: events_pb2.Result
    audit: AuditView | None = None

    @classmethod
    def from_events(cls, events: Iterable[events_pb2.RunEvent]) -> RecordedRun:
        """A record of the events of a run's stream (Execute or WatchRun), Result last.

        Raises:
            ValueError: The events hold no Result.
        """
        events = list(events)
        if not events or not events[-1].HasField("result"):
            raise ValueError("the events end without a Result")
        return cls(events=events, result=events[-1].result)

    @property
    def run_id(self) -> str:
        """The run's id."""
        return self.events[0].run_id

    @property
    def outcome(self) -> Outcome:
        """How the run ended."""
        return Outcome(self.result.outcome)

    @property
    def output(self) -> str:
        """The text for the model."""
        return self.result.output

    @property
    def error_code(self) -> str:
        """The stable error code when the outcome is not OK, else empty."""
        return self.result.error.code

    @property
    def deltas(self) -> str:
        """All streamed output, concatenated."""
        return "".join(e.step.delta for e in self.events
                       if e.HasField("step") and e.step.phase == events_pb2.STEP_PHASE_DELTA)

    @property
    def step_titles(self) -> list[str]:
        """Titles of the steps started, in order (the tool call itself first)."""
        return [e.step.step.title for e in self.events
                if e.HasField("step") and e.step.phase == events_pb2.STEP_PHASE_START]

    @property
    def steps(self) -> StepNode:
        """The step tree: the tool call itself at the root, the tool's steps nested inside."""
        nodes: dict[str, StepNode] = {}
        roots: list[StepNode] = []
        for event in self.events:
            if not event.HasField("step"):
                continue
            phase, proto = event.step.phase, event.step.step
            if phase == events_pb2.STEP_PHASE_START:
                node = nodes[proto.id] = StepNode(Step.from_proto(proto))
                parent = nodes.get(proto.parent_id)
                (parent.children if parent is not None else roots).append(node)
            elif proto.id in nodes:
                node = nodes[proto.id]
                if phase == events_pb2.STEP_PHASE_DELTA:
                    node.deltas += event.step.delta
                elif phase == events_pb2.STEP_PHASE_END:
                    node.step = Step.from_proto(proto)
        if not roots:
            raise ValueError("the run started no step")
        return roots[0]

    @property
    def heartbeats(self) -> list[Heartbeat]:
        """The heartbeats sent."""
        return [_typed(e, Heartbeat) for e in self.events if e.HasField("heartbeat")]

    @property
    def notices(self) -> list[Notice]:
        """The server's notices about the run (critic warnings, steering …)."""
        return [_typed(e, Notice) for e in self.events if e.HasField("notice")]

    @property
    def sent_files(self) -> list[SentFile]:
        """The files the tool sent back, each with its whole content (a large file's
        chunks put back together)."""
        chunks = StreamedFiles()
        for event in self.events:
            if event.HasField("file_chunk"):
                chunk = event.file_chunk
                chunks.add(chunk.file_id, chunk.offset, chunk.data)
        files = []
        for f in self.result.writeback.sent_files:
            content = (chunks.content(f.file_id, f.size, f.sha256) or b"") if f.streamed \
                else f.content
            files.append(SentFile(file_id=f.file_id, name=f.name, mime_type=f.mime_type,
                                  size=f.size, sha256=f.sha256, content=content,
                                  streamed=f.streamed))
        return files

    @property
    def injected_tools(self) -> list[InjectedTool]:
        """The tools the run asked the agent to add."""
        return _final(self).injected_tools

    @property
    def rich_messages(self) -> list[RichMessage]:
        """The rich messages (cards, charts …) the tool posted."""
        return _final(self).rich_messages


_T = TypeVar("_T")


def _typed(event: events_pb2.RunEvent, kind: type[_T]) -> _T:
    typed = event_from_proto(event)
    assert isinstance(typed, kind)
    return typed


def _final(recorded: RecordedRun) -> Any:
    return event_from_proto(recorded.events[-1])


def _spec(tool: Callable[..., Any] | ToolSpec) -> ToolSpec:
    if isinstance(tool, ToolSpec):
        return tool
    spec = spec_of(tool)
    if spec is None:
        raise ToolDefinitionError(f"{getattr(tool, '__name__', tool)!r} is not a @tool() function")
    return spec


async def run_tool(tool: Callable[..., Any] | ToolSpec,
                   arguments: Mapping[str, Any] | BaseModel | None = None, *,
                   principal: Principal = TEST_PRINCIPAL, settings: Settings | None = None,
                   invocation: Mapping[str, Any] | None = None,
                   on_start: Callable[[Run], None] | None = None) -> RecordedRun:
    """Runs one tool to its end and records its events.

    The run goes through the runtime a server with ``settings`` builds
    (:func:`stargrpc.server.build_runtime`): the permission policy, the argument limits
    and the run pipeline with supervision.

    Args:
        tool: A ``@tool()`` function or its spec.
        arguments: A dict (validated exactly as the server would: lenient coercion, unknown
            fields rejected) or an instance of the tool's argument model.
        principal: Who calls; by default a caller holding every role. Give a
            :class:`~stargrpc.Principal` with fewer roles to test the permissions.
        settings: Server settings (permissions, critic, limits; the tool reads them
            through ``ctx.settings``).
        invocation: The invocation context (end user, channel, labels …).
        on_start: Called with the run just after it starts (e.g. to cancel it later with
            ``run.stop(...)``).

    Raises:
        InvalidArgument: The arguments do not fit the tool's model.
        PermissionDenied: The principal may not run the tool (or act for the end user the
            invocation names).
        CriticConfigError: The tool's critic (or the settings') cannot be loaded.
    """
    spec = _spec(tool)
    if isinstance(arguments, BaseModel):
        arguments = arguments.model_dump(mode="json", by_alias=True)
    settings = settings if settings is not None else Settings()
    runtime = build_runtime(settings, Registry([spec]))
    call = RunRequest(tool_name=spec.name, arguments=dict(arguments or {}),
                       invocation=dict(invocation or {}))
    try:
        admitted = await runtime.admit(call, principal)
        run = admitted.run
        assert run is not None  # no idempotency key: always a new run
        if on_start is not None:
            on_start(run)
        result = await run.wait()
        events = [event async for event in run.log.follow(0)]
    finally:
        await runtime.aclose()
    view = AuditLimits.from_settings(settings)
    audit = AuditView(
        arguments_text=view.arguments_text(run.audit_arguments if run.audit_arguments
                                           is not None else call.arguments),
        result=view.result_text(result, run.audit_result))
    return RecordedRun(events=events, result=result, audit=audit)


def run_tool_sync(tool: Callable[..., Any] | ToolSpec,
                  arguments: Mapping[str, Any] | BaseModel | None = None,
                  **options: Any) -> RecordedRun:
    """:func:`run_tool` for synchronous tests."""
    return asyncio.run(run_tool(tool, arguments, **options))


async def record(client: AsyncClient, tool: str,
                 arguments: Mapping[str, Any] | None = None, **options: Any) -> RecordedRun:
    """Runs ``tool`` through ``client`` (a real server) and records the stream's events.

    Args:
        client: E.g. the one :func:`serve` gives.
        tool: The tool's name.
        arguments: Its arguments.
        options: Passed on to :meth:`AsyncClient.execute`.
    """
    events = [event.raw async for event in client.execute(tool, arguments, **options)]
    return RecordedRun.from_events(events)


@dataclass
class ServedTools:
    """A real server running the given tools, started by :func:`serve_tools`.

    Attributes:
        server: The server.
        keys: The API key of each named caller (empty with authentication off).
    """

    server: StargrpcServer
    keys: dict[str, str]
    _clients: list[AsyncClient] = field(default_factory=list)

    @property
    def target(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.server.port}"

    def client(self, caller: str | None = None) -> AsyncClient:
        """A client connected to the server, calling as ``caller`` (one of ``keys``; by
        default the first). Closed with the server.

        Raises:
            KeyError: No caller of that name.
        """
        key = None
        if self.keys:
            key = self.keys[caller if caller is not None else next(iter(self.keys))]
        elif caller is not None:
            raise KeyError(f"{caller!r}: the server runs without authentication")
        client = AsyncClient.connect(self.target, api_key=key)
        self._clients.append(client)
        return client

    async def aclose(self) -> None:
        """Closes the clients and stops the server."""
        for client in self._clients:
            await client.close()
        await self.server.stop(grace=1.0)


@asynccontextmanager
async def serve_tools(*tools: Callable[..., Any] | ToolSpec,
                      keys: Mapping[str, Iterable[str]] | None = None,
                      settings: Settings | None = None,
                      **overrides: Any) -> AsyncIterator[ServedTools]:
    """A real server on ``127.0.0.1:0`` with ``tools``, stopped on leaving.

    Args:
        tools: ``@tool()`` functions or specs.
        keys: Callers and their roles, e.g. ``{"alice": ["analyst"]}``: each gets an API
            key and authentication is on. Without, authentication is off and every caller
            holds every role.
        settings: Base settings (host, port and state directory are set here).
        overrides: Further settings, by name.
    """
    with tempfile.TemporaryDirectory(prefix="stargrpc-test-") as tmp:
        state = Path(tmp)
        values: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "state_dir": state,
                                  "shutdown_grace_seconds": 1.0, **overrides}
        issued: dict[str, str] = {}
        if keys:
            store = KeyStore(state / "keys.json")
            issued = {name: store.create(name, roles)[1] for name, roles in keys.items()}
            values.update(insecure_no_auth=False, keys_file=state / "keys.json")
        else:
            values.setdefault("insecure_no_auth", True)
        configured = (settings.model_copy(update=values) if settings is not None
                      else Settings.load(**values))
        server = StargrpcServer(configured,
                                registry=Registry([_spec(tool) for tool in tools]))
        await server.start()
        served = ServedTools(server, issued)
        try:
            yield served
        finally:
            await served.aclose()


@asynccontextmanager
async def serve(*tools: Callable[..., Any] | ToolSpec,
                roles: Iterable[str] | None = None, settings: Settings | None = None,
                **overrides: Any) -> AsyncIterator[AsyncClient]:
    """A connected client to a real server running ``tools`` on ``127.0.0.1:0`` (as
    grpclib's ``ChannelFor``)::

        async with serve(count) as client:
            result = await client.call("count", {"to": 2})

    Args:
        tools: ``@tool()`` functions or specs.
        roles: The caller's roles: authentication is on and the client holds a key with
            these roles. Without, authentication is off (every role).
        settings: Base settings.
        overrides: Further settings, by name.
    """
    keys = {"tester": list(roles)} if roles is not None else None
    async with serve_tools(*tools, keys=keys, settings=settings, **overrides) as served:
        yield served.client()


def load_tool_module(path: str | Path) -> ModuleType:
    """Imports a tool module of a tools directory by its path, whatever the current
    directory and whether or not the directory is a package, under the name the server's
    loader gives it::

        count = load_tool_module(Path(__file__).parent.parent / "tools" / "count.py").count

    Raises:
        ToolDefinitionError: The file cannot be imported.
    """
    return import_tool_module(Path(path))
