"""RemoteToolRegistry against real servers: up, down, refusing, stalled, and killed mid-call.

The registry's local tools and the server's come from the same tool functions and modules,
so a run that happens in the wrong place shows up: the ``tally`` tool writes one line per
real run, the server's recorder lists every Execute it received, and every local run
leaves a ``local_audit`` log line (and a record in the local audit store, when given).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import BaseModel, Field
from structlog.testing import capture_logs

from stargrpc import ToolContext, ToolDenied, tool
from stargrpc.audit import AuditStore, Query, open_store
from stargrpc.client import (
    CallError,
    ClientError,
    Event,
    FileChunk,
    ResumeError,
    RetryPolicy,
    StepStarted,
)
from stargrpc.errors import PermissionDenied, Unavailable
from stargrpc.principal import Principal
from stargrpc.registry import Registry, load_directory, load_registry, spec_of
from stargrpc.remote_registry import (
    FALLBACK_METHOD,
    IN_PROCESS_METHOD,
    CollectedWriteBack,
    RemoteToolRegistry,
)
from stargrpc.runs.outcome import Outcome
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.streaming import serialize_response
from stargrpc.settings import Settings
from stargrpc.v1 import tool_service_pb2
from tests.client.conftest import FAST_RETRY
from tests.client.faults import Recorder
from tests.conftest import ServerFactory
from tests.procs import ServerProcess, server_env
from tests.run_tools.blob import blob_bytes
from tests.runs_support import RUN_TOOLS_DIR, HeaderPrincipal

#: Long enough for any single wait in these tests; none should come near it.
BOUND = 30.0


class NoteArgs(BaseModel):
    text: str = Field(description="What to deliver.")


@tool(kind="test")
async def courier(ctx: ToolContext, args: NoteArgs) -> str:
    """Hand something back on every write-back channel."""
    async with ctx.step("Delivering") as step:
        await step.delta(args.text)
    ctx.send_file("note.txt", args.text.encode(), "text/plain")
    ctx.inject_tool("follow_up", "Call this next.", {"type": "object", "properties": {}})
    ctx.send_rich_message("card", {"title": args.text})
    return f"delivered {args.text}"


@tool(kind="test", privileged=True)
async def launch(ctx: ToolContext, args: NoteArgs) -> str:
    """A privileged tool."""
    return f"launched {args.text}"


@tool(kind="test", soft_timeout=0.3)
async def stuck(ctx: ToolContext, args: NoteArgs) -> str:
    """Never makes progress."""
    await asyncio.Event().wait()
    return "unreachable"


@tool(kind="test")
async def refuse(ctx: ToolContext, args: NoteArgs) -> str:
    """Ends every run DENIED."""
    raise ToolDenied(f"not for {args.text}")


@tool(kind="test")
async def connect(ctx: ToolContext, args: NoteArgs) -> dict[str, str]:
    """Returns what a careless tool might: a secret in its structured output."""
    return {"url": f"postgresql://app:{args.text}@db/app", "token": args.text}


@tool(kind="test")
async def late(ctx: ToolContext, args: NoteArgs) -> str:
    """Added to the server's catalog after the registry loaded it."""
    return args.text


#: The agent runtime's own tools: the test tool modules and the tools above.
LOCAL = Registry([*load_directory(RUN_TOOLS_DIR),
                  *(spec for spec in map(spec_of, (courier, launch, stuck, refuse, connect))
                    if spec is not None)])
#: The server's: the same, plus the bundled tools (``echo`` is not held locally).
SERVER = Registry([*load_registry().values(), *LOCAL.values()])

Opener = Callable[..., Awaitable[RemoteToolRegistry]]


@pytest.fixture
async def open_registry() -> AsyncIterator[Opener]:
    """Starts registries: ``await open_registry(target_or_None, **options)``; each is closed
    at the end of the test."""
    opened: list[RemoteToolRegistry] = []

    async def factory(target: str | None, **options: Any) -> RemoteToolRegistry:
        options.setdefault("local", LOCAL)
        options.setdefault("retry", FAST_RETRY)
        if target is None:
            registry = RemoteToolRegistry(mode="in_process", **options)
        else:
            registry = RemoteToolRegistry.connect(target, **options)
        await registry.start()
        opened.append(registry)
        return registry

    yield factory
    for registry in opened:
        await registry.close()


@pytest.fixture
async def audit_store(tmp_path: Path) -> AsyncIterator[AuditStore]:
    """A local audit store, opened."""
    store = open_store(f"sqlite:///{tmp_path / 'local-audit.db'}")
    await store.open()
    yield store
    await store.aclose()


async def _recorded(make_server: ServerFactory, recorder: Recorder, *extra: Any,
                    **settings: Any) -> StargrpcServer:
    return await make_server(registry=SERVER, interceptors=[recorder, *extra], **settings)


async def _down_target(make_server: ServerFactory) -> str:
    """The address of a server that has stopped: connections are refused."""
    server = await make_server(registry=SERVER)
    await server.stop(grace=0)
    return f"127.0.0.1:{server.port}"


def _tally_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _local_audits(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in logs if line["event"] == "local_audit"]


def _writeback(collected: CollectedWriteBack) -> tuple[object, ...]:
    return ([(f.name, f.mime_type, f.size, f.sha256, f.content) for f in collected.sent_files],
            [(t.name, t.description, t.input_schema) for t in collected.injected_tools],
            [(m.kind, m.payload) for m in collected.sent_rich_messages])


# -- server up -------------------------------------------------------------------------------

async def test_a_remote_call_runs_on_the_server_with_the_same_writeback_as_in_process(
        make_server: ServerFactory, recorder: Recorder, open_registry: Opener) -> None:
    server = await _recorded(make_server, recorder)
    remote = await open_registry(f"127.0.0.1:{server.port}")
    in_process = await open_registry(None)
    into_remote, into_local = CollectedWriteBack(), CollectedWriteBack()
    seen: list[Event] = []

    with capture_logs() as logs:
        result = await remote.call("courier", {"text": "hi"}, into=into_remote,
                                   on_event=seen.append)
        local_result = await in_process.call("courier", {"text": "hi"}, into=into_local)

    assert result.ok and result.output == local_result.output == "delivered hi"
    assert len(recorder.seen("Execute")) == 1 and seen[-1] is result
    assert [event.seq for event in seen] == list(range(1, len(seen) + 1))
    assert [line["method"] for line in _local_audits(logs)] == [IN_PROCESS_METHOD]
    assert _writeback(into_remote) == _writeback(into_local)
    assert into_remote.sent_files[0].content == b"hi"
    assert into_remote.injected_tools[0].name == "follow_up"
    assert into_remote.sent_rich_messages[0].payload == {"title": "hi"}


async def test_a_chunked_file_comes_back_whole_in_both_modes(
        make_server: ServerFactory, recorder: Recorder, open_registry: Opener) -> None:
    server = await _recorded(make_server, recorder)
    size = 3 * 1024 * 1024
    expected = hashlib.sha256(blob_bytes(size, 7)).hexdigest()
    for registry in (await open_registry(f"127.0.0.1:{server.port}"),
                     await open_registry(None)):
        into = CollectedWriteBack()
        seen: list[Event] = []
        result = await registry.call("blob", {"size": size, "seed": 7}, into=into,
                                     on_event=seen.append)
        assert result.ok and any(isinstance(event, FileChunk) for event in seen), \
            "the file should travel as chunks"
        (sent,) = result.files
        assert sent.streamed and hashlib.sha256(sent.content).hexdigest() == expected
        assert into.sent_files == [sent]


async def test_pinned_tools_never_go_remote(make_server: ServerFactory, recorder: Recorder,
                                            open_registry: Opener, tmp_path: Path) -> None:
    server = await _recorded(make_server, recorder)
    registry = await open_registry(f"127.0.0.1:{server.port}",
                                   tools_force_in_process={"tally"})
    tally_file = tmp_path / "tally.txt"

    with capture_logs() as logs:
        result = await registry.call("tally", {"path": str(tally_file), "deltas": 1})

    assert result.ok and len(_tally_lines(tally_file)) == 1
    assert recorder.seen("Execute") == []
    assert [line["method"] for line in _local_audits(logs)] == [IN_PROCESS_METHOD]
    with pytest.raises(ValueError, match="echo"):
        RemoteToolRegistry(mode="in_process", local=LOCAL, tools_force_in_process={"echo"})


async def test_the_catalog_fast_fails_a_tool_the_caller_may_not_run(
        make_server: ServerFactory, recorder: Recorder, open_registry: Opener) -> None:
    server = await _recorded(make_server, recorder, HeaderPrincipal(),
                             tool_permissions={"courier": {"roles": ["ops"]}},
                             list_tools_show_uncallable=True)
    registry = await open_registry(f"127.0.0.1:{server.port}",
                                   metadata=(("x-test-principal", "bob"),))
    assert registry.catalog is not None and not registry.is_allowed("courier")

    with capture_logs() as logs, pytest.raises(CallError) as refused:
        await registry.call("courier", {"text": "x"})

    assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.reason == "TOOL_NOT_ALLOWED"
    assert recorder.seen("Execute") == [] and _local_audits(logs) == []
    # The fast-fail holds for tools the runtime could run itself too.
    pinned = await open_registry(f"127.0.0.1:{server.port}", tools_force_in_process={"courier"},
                                 metadata=(("x-test-principal", "bob"),))
    with pytest.raises(CallError, match="not callable"):
        await pinned.call("courier", {"text": "x"})
    assert (await registry.call("tally", {"path": os.devnull, "deltas": 0})).ok


async def test_a_stale_catalog_is_reloaded_once_and_the_call_retried(
        make_server: ServerFactory, recorder: Recorder, open_registry: Opener) -> None:
    server = await _recorded(make_server, recorder)
    registry = await open_registry(f"127.0.0.1:{server.port}")
    assert registry.catalog is not None
    old_hash = registry.catalog.catalog_hash
    late_spec = spec_of(late)
    assert late_spec is not None
    server.runtime.replace_registry(Registry([*SERVER.values(), late_spec]))

    result = await registry.call("courier", {"text": "again"})

    assert result.ok
    executes = recorder.seen("Execute")
    assert [call.request.catalog_hash for call in executes] == [
        old_hash, server.runtime.registry.catalog_hash]
    assert len(recorder.seen("ListTools")) == 2
    assert registry.catalog.catalog_hash == server.runtime.registry.catalog_hash != old_hash
    assert "late" in registry.tool_names()


async def test_refusals_and_bad_outcomes_from_the_server_are_answers_not_fallbacks(
        make_server: ServerFactory, recorder: Recorder, open_registry: Opener,
        tmp_path: Path) -> None:
    server = await _recorded(make_server, recorder)
    registry = await open_registry(f"127.0.0.1:{server.port}")
    tally_file = tmp_path / "tally.txt"
    recorder.fail("Execute", PermissionDenied("no tally for you", reason="TOOL_NOT_ALLOWED"))

    with capture_logs() as logs:
        with pytest.raises(CallError) as refused:
            await registry.call("tally", {"path": str(tally_file)})
        denied = await registry.call("refuse", {"text": "bob"})
        with pytest.raises(CallError) as invalid:
            await registry.call("tally", {"path": str(tally_file), "deltas": "many"})

    assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert denied.outcome is Outcome.DENIED
    assert invalid.value.violations and invalid.value.violations[0].field.endswith("deltas")
    assert _tally_lines(tally_file) == [] and _local_audits(logs) == []


async def test_a_draining_server_falls_back(make_server: ServerFactory, recorder: Recorder,
                                            open_registry: Opener, audit_store: AuditStore,
                                            tmp_path: Path) -> None:
    server = await _recorded(make_server, recorder)
    registry = await open_registry(f"127.0.0.1:{server.port}", audit_store=audit_store)
    recorder.fail("Execute", Unavailable("draining", reason="DRAINING"),
                  times=FAST_RETRY.max_attempts)
    tally_file = tmp_path / "tally.txt"

    result = await registry.call("tally", {"path": str(tally_file), "deltas": 0})

    assert result.ok and len(_tally_lines(tally_file)) == 1
    assert len(recorder.seen("Execute")) == FAST_RETRY.max_attempts
    (record,) = await audit_store.query(Query())
    assert record.method == FALLBACK_METHOD and "UNAVAILABLE" in record.detail


# -- server down -----------------------------------------------------------------------------

async def test_a_down_server_falls_back_to_the_local_tool_logged_and_audited(
        make_server: ServerFactory, open_registry: Opener, audit_store: AuditStore,
        tmp_path: Path) -> None:
    target = await _down_target(make_server)
    tally_file = tmp_path / "tally.txt"
    with capture_logs() as logs:
        registry = await open_registry(target, audit_store=audit_store)
        seen: list[Event] = []
        into = CollectedWriteBack()
        result = await registry.call("tally", {"path": str(tally_file), "deltas": 2},
                                     on_event=seen.append, context={"trace_id": "t-1"})
        courier_result = await registry.call("courier", {"text": "offline"}, into=into)

    assert registry.catalog is None
    assert result.ok and result.output == "tallied 2"
    assert len(_tally_lines(tally_file)) == 1
    assert isinstance(seen[0], StepStarted) and seen[-1] is result
    assert courier_result.ok and into.sent_files[0].content == b"offline"
    fallbacks = [line for line in logs if line["event"] == "tool_fallback"]
    assert [(line["tool"], line["code"], line["log_level"]) for line in fallbacks] == [
        ("tally", "UNAVAILABLE", "warning"), ("courier", "UNAVAILABLE", "warning")]
    records = await audit_store.query(Query(method="LocalFallback"))
    assert [(r.tool, r.outcome, r.peer, r.method) for r in records] == [
        ("tally", "ok", "local", FALLBACK_METHOD), ("courier", "ok", "local", FALLBACK_METHOD)]
    assert records[0].run_id == result.run_id and '"t-1"' in records[0].invocation
    assert str(tally_file) in records[0].arguments


async def test_a_down_server_and_a_tool_not_held_locally_fails_clearly(
        make_server: ServerFactory, open_registry: Opener) -> None:
    registry = await open_registry(await _down_target(make_server))

    with pytest.raises(CallError) as failed:
        await registry.call("echo", {"text": "hi"})

    assert failed.value.code is grpc.StatusCode.UNAVAILABLE
    assert "'echo' is not held locally" in failed.value.message


async def test_without_local_fallback_a_down_server_is_the_callers_error(
        make_server: ServerFactory, open_registry: Opener, tmp_path: Path) -> None:
    registry = await open_registry(await _down_target(make_server), local_fallback=False)
    tally_file = tmp_path / "tally.txt"

    with pytest.raises(CallError) as failed:
        await registry.call("tally", {"path": str(tally_file)})

    assert failed.value.code is grpc.StatusCode.UNAVAILABLE and _tally_lines(tally_file) == []


@contextlib.asynccontextmanager
async def _silent_listener() -> AsyncIterator[str]:
    """A TCP port that accepts connections and never answers (a hung server)."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    finally:
        listener.close()
        for writer in held:
            writer.transport.abort()


async def test_a_server_that_never_connects_falls_back_after_connect_timeout(
        open_registry: Opener, tmp_path: Path) -> None:
    tally_file = tmp_path / "tally.txt"
    async with _silent_listener() as target:
        registry = RemoteToolRegistry.connect(target, local=LOCAL, retry=FAST_RETRY,
                                              connect_timeout=0.3)
        try:
            with capture_logs() as logs:
                result = await asyncio.wait_for(
                    registry.call("tally", {"path": str(tally_file), "deltas": 0}), BOUND)
        finally:
            await registry.close()

    assert result.ok and len(_tally_lines(tally_file)) == 1
    assert [line["code"] for line in logs if line["event"] == "tool_fallback"] == [
        "DEADLINE_EXCEEDED"]


async def test_no_fallback_once_the_callers_deadline_has_passed(
        open_registry: Opener, tmp_path: Path) -> None:
    tally_file = tmp_path / "tally.txt"
    async with _silent_listener() as target:
        registry = RemoteToolRegistry.connect(target, local=LOCAL, retry=FAST_RETRY)
        try:
            with pytest.raises(CallError) as failed:
                await registry.call("tally", {"path": str(tally_file)}, timeout=0.3)
        finally:
            await registry.close()

    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert _tally_lines(tally_file) == []


class _Stall(grpc.aio.ServerInterceptor):
    """Holds every Execute before the service sees it, as an overloaded server would."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.endswith("/Execute"):
            await asyncio.Event().wait()
        return await continuation(details)


async def test_a_connected_server_that_misses_the_deadline_is_not_a_fallback(
        make_server: ServerFactory, open_registry: Opener, tmp_path: Path) -> None:
    server = await make_server(registry=SERVER, interceptors=[_Stall()])
    registry = await open_registry(f"127.0.0.1:{server.port}", connect_timeout=0.3)
    tally_file = tmp_path / "tally.txt"

    with pytest.raises(CallError) as failed:
        await registry.call("tally", {"path": str(tally_file)}, timeout=0.5)

    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert _tally_lines(tally_file) == []


# -- server dying mid-call -------------------------------------------------------------------

#: Resuming waits longer than the call has left: the client gives up with the UNAVAILABLE
#: of the failed resume (a CallError) rather than a ResumeError.
SLOW_RESUME = RetryPolicy(max_attempts=3, initial_backoff=5.0, max_backoff=5.0, jitter=0.0)


@pytest.mark.parametrize(("retry", "call_timeout", "error"), [
    (FAST_RETRY, None, ResumeError), (SLOW_RESUME, 3.0, CallError)])
async def test_a_server_killed_after_the_run_started_is_not_a_fallback(
        open_registry: Opener, audit_store: AuditStore, tmp_path: Path, retry: RetryPolicy,
        call_timeout: float | None, error: type[ClientError]) -> None:
    server = await asyncio.to_thread(ServerProcess, ["--tools-dir", str(RUN_TOOLS_DIR)],
                                     server_env(tmp_path / "state"))
    tally_file, gate = tmp_path / "tally.txt", tmp_path / "never-opened"
    try:
        registry = await open_registry(server.target, audit_store=audit_store, retry=retry)
        seen: list[Event] = []

        def kill_once_the_tool_ran(event: Event) -> None:
            seen.append(event)
            # tally writes its line before it opens its own step.
            if isinstance(event, StepStarted) and event.step.title == "Tallying":
                os.killpg(server.proc.pid, signal.SIGKILL)

        with capture_logs() as logs, pytest.raises(error) as broken:
            await asyncio.wait_for(registry.call(
                "tally", {"path": str(tally_file), "gate": str(gate)},
                on_event=kill_once_the_tool_ran, timeout=call_timeout), BOUND)
    finally:
        await asyncio.to_thread(server.stop)

    assert any(isinstance(e, StepStarted) and e.step.title == "Tallying" for e in seen)
    if isinstance(broken.value, ResumeError):
        assert broken.value.run_id == seen[0].run_id
    else:
        assert isinstance(broken.value, CallError)
        assert broken.value.code is grpc.StatusCode.UNAVAILABLE
    assert len(_tally_lines(tally_file)) == 1, "the tool must not run a second time"
    assert _local_audits(logs) == [] and await audit_store.query(Query()) == []
    assert not any(line["event"] == "tool_fallback" for line in logs)


# -- in process ------------------------------------------------------------------------------

async def test_in_process_runs_go_through_the_runtime_pipeline(
        open_registry: Opener, tmp_path: Path) -> None:
    registry = await open_registry(None)

    with pytest.raises(CallError) as privileged:
        await registry.call("launch", {"text": "x"})
    with pytest.raises(CallError) as invalid:
        await registry.call("courier", {"txt": "x"})
    with pytest.raises(CallError) as unknown:
        await registry.call("echo", {"text": "x"})
    stuck_result = await registry.call("stuck", {"text": "x"})
    late_result = await registry.call(
        "tally", {"path": str(tmp_path / "t.txt"), "gate": str(tmp_path / "never")},
        timeout=0.3)

    assert (privileged.value.code, privileged.value.reason) == (
        grpc.StatusCode.PERMISSION_DENIED, "PRIVILEGED_ROLE_REQUIRED")
    assert invalid.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert {v.field for v in invalid.value.violations} >= {"arguments.text"}
    assert (unknown.value.code, unknown.value.reason) == (
        grpc.StatusCode.NOT_FOUND, "TOOL_NOT_FOUND")
    assert (stuck_result.outcome, stuck_result.error_code) == (
        Outcome.TIMEOUT, "CRITIC_NO_PROGRESS")
    assert (late_result.outcome, late_result.error_code) == (Outcome.TIMEOUT, "CLIENT_DEADLINE")
    trusted = await open_registry(None, principal=Principal(
        id="agent", roles=frozenset({"privileged"}), method="local"))
    assert (await trusted.call("launch", {"text": "x"})).output == "launched x"


async def test_a_local_audit_record_is_redacted_as_the_servers_are(
        open_registry: Opener, audit_store: AuditStore) -> None:
    registry = await open_registry(None, audit_store=audit_store)
    result = await registry.call("connect", {"text": "hunter2"})

    assert "hunter2" in result.output  # the caller gets what the tool returned
    (record,) = await audit_store.query(Query())
    assert json.loads(record.result) == {"url": "postgresql://app:<redacted>@db/app",
                                         "token": "<redacted>"}


async def test_a_cancelled_in_process_call_stops_its_run(open_registry: Opener,
                                                         tmp_path: Path) -> None:
    registry = await open_registry(None)
    started = asyncio.Event()
    call = asyncio.create_task(registry.call(
        "tally", {"path": str(tmp_path / "t.txt"), "gate": str(tmp_path / "never")},
        on_event=lambda event: started.set()))
    await asyncio.wait_for(started.wait(), BOUND)
    (run,) = registry.runtime.runs.values()

    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    result = await asyncio.wait_for(run.wait(), BOUND)

    assert result.outcome == Outcome.CANCELLED.value


@tool(kind="test")
async def verbose(ctx: ToolContext, args: NoteArgs) -> str:
    """Returns two mebibytes of text: more than a Result of a 1 MiB send limit holds."""
    return args.text * (2 * 1024 * 1024 // max(1, len(args.text)))


async def test_a_local_audit_record_says_what_was_cut_as_the_servers_do(
        open_registry: Opener, audit_store: AuditStore) -> None:
    spec = spec_of(verbose)
    assert spec is not None
    registry = await open_registry(None, audit_store=audit_store, local=Registry([spec]),
                                   settings=Settings(max_send_message_bytes=1024 * 1024))
    result = await registry.call("verbose", {"text": "words "})

    assert "[output truncated: " in result.output
    (record,) = await audit_store.query(Query())
    assert record.outcome == "ok"
    assert record.detail.startswith("OUTPUT_TRUNCATED: the output (")


class _CorruptChunks(grpc.aio.ServerInterceptor):
    """Flips the first byte of every FileChunk an Execute stream sends: the file arrives
    whole in size, and not the file the Result's sha256 names."""

    async def intercept_service(self, continuation: Any,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.endswith("/Execute"):
            return handler
        inner = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for frame in inner(request, context):
                response = tool_service_pb2.ExecuteResponse.FromString(
                    serialize_response(frame))
                chunk = response.event.file_chunk
                if response.event.HasField("file_chunk") and chunk.data:
                    chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
                yield response

        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer)


async def test_a_chunked_file_whose_bytes_do_not_match_its_sha256_is_not_handed_on(
        make_server: ServerFactory, recorder: Recorder, open_registry: Opener) -> None:
    server = await _recorded(make_server, recorder, _CorruptChunks())
    registry = await open_registry(f"127.0.0.1:{server.port}")
    into = CollectedWriteBack()

    result = await registry.call("blob", {"size": 3 * 1024 * 1024, "seed": 7}, into=into)

    # As with a chunk missing: listed, never with bytes that are not the file's (they were
    # handed on as its content).
    (sent,) = result.files
    assert sent.streamed and sent.size == 3 * 1024 * 1024 and sent.content == b""
    assert into.sent_files == [sent]
