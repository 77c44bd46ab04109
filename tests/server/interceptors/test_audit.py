"""The audit interceptor through a real server: one record per call attempt, whatever its
fate, with secrets redacted, the tool's own audit view honoured, the outcome named, the log
line at the right level with the run id, and every record flushed on a clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import jwt
import pytest
from pydantic import BaseModel, Field

from stargrpc import ToolContext, ToolFailed, tool
from stargrpc.audit.chain import verify
from stargrpc.audit.key import default_key_path, load_key
from stargrpc.audit.record import AuditRecord
from stargrpc.audit.store import Query, default_store_url, open_store
from stargrpc.ids import minted_ms
from stargrpc.registry import Registry, spec_of
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors.audit import BUSY_EXECUTES, AuditInterceptor
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.audit.helpers import pg_schema
from tests.conftest import ServerFactory
from tests.helpers import eventually, run_tool

WAIT = 30.0  # generous bound on waits; never a claim about speed
JWT_SECRET = "an-hs256-test-secret-that-is-long-enough-0123456789"
EXECUTE = "/stargrpc.v1.ToolService/Execute"


class Login(BaseModel):
    user: str
    password: str
    options: dict[str, Any] = Field(default_factory=dict)


@tool()
async def login(ctx: ToolContext, args: Login) -> dict[str, Any]:
    """Pretends to log in; returns a session token."""
    return {"user": args.user, "session_token": "tok-SECRET-RESULT"}


class Paste(BaseModel):
    text: str


@tool()
async def paste(ctx: ToolContext, args: Paste) -> str:
    """Returns a link whose fragment is a key: the model needs it, the audit must not."""
    ctx.audit_view(arguments={"text": f"<{len(args.text)} chars>"}, result="paste created")
    return "https://paste.example/p/1#key-SECRET-FRAGMENT"


class Command(BaseModel):
    command: str
    env: dict[str, str] = Field(default_factory=dict)


@tool(privileged=True, allowed_roles=("ops",))
async def run_command(ctx: ToolContext, args: Command) -> str:
    """A privileged tool."""
    return "done"


@tool(allowed_roles=("ops",))
async def ops_only(ctx: ToolContext) -> str:
    """Only for the ops role."""
    return "ok"


@tool()
async def fails(ctx: ToolContext) -> str:
    """Ends FAILED."""
    raise ToolFailed("the backend said no")


@tool()
async def crashes(ctx: ToolContext) -> str:
    """Ends ERROR."""
    raise RuntimeError("boom")


@tool()
async def waits(ctx: ToolContext) -> str:
    """Runs until cancelled (bounded)."""
    await ctx.delta("started")
    await asyncio.sleep(WAIT)
    return "never"


@tool()
async def odd_name(ctx: ToolContext) -> str:
    """A file name as os.listdir gives one that is not UTF-8 (surrogateescape)."""
    ctx.send_file("sent-\udcff.txt", b"x")
    async with ctx.step("listing \udcff") as step:
        await step.delta("found \udcff\n")
    return "report-\udcff.txt"


def _registry() -> Registry:
    specs = (spec_of(fn) for fn in (login, paste, run_command, ops_only, fails, crashes,
                                    waits, odd_name))
    return Registry(spec for spec in specs if spec is not None)


async def _records(server: StargrpcServer) -> list[AuditRecord]:
    """Every record of the server's store, once every call's record is handed to the writer
    and the writer has caught up (a client holds its status before the record of its call is
    handed over: it is written as the server's handler unwinds)."""
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await eventually(lambda: audit.open_calls == 0, what="every open call's record written")
    await audit.writer.flush()
    return [r async for r in audit.writer.store.scan()]


@pytest.fixture
async def server(make_server: ServerFactory) -> StargrpcServer:
    return await make_server(registry=_registry())


@pytest.fixture
async def stub(server: StargrpcServer) -> AsyncIterator[tool_service_pb2_grpc.ToolServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


def _parsed(buffer: io.StringIO, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in buffer.getvalue().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


async def test_an_execute_leaves_one_complete_record(server, stub) -> None:
    events = await run_tool(stub, "login", {"user": "ann", "password": "pw"},
                            idempotency_key="k-1")

    [record] = await _records(server)
    assert record.method == EXECUTE
    assert record.outcome == "ok"
    assert record.tool == "login"
    assert record.run_id == events[-1].run_id
    assert record.peer.startswith("ipv4:127.0.0.1:")
    assert record.principal == "local"
    assert record.auth_method == "none"
    assert record.idempotency_key == "k-1"
    assert record.privileged is False
    assert record.duration_ms > 0
    assert record.seq == 1 and record.hash
    # Its id says when it was made: the trail's index of ids grows at its end.
    assert minted_ms(record.id) is not None
    assert json.loads(record.arguments) == {"user": "ann", "password": "<redacted>"}
    assert json.loads(record.result) == {"user": "ann", "session_token": "<redacted>"}


async def test_secrets_never_reach_the_store_or_the_log(server, stub, log_lines) -> None:
    arguments = {"user": "ann", "password": "hunter2-SECRET",
                 "options": {"hosts": [{"name": "db", "api_key": "ak-SECRET"}],
                             "headers": {"Authorization": "Bearer SECRET-TOKEN"},
                             "note": "n" * 3000}}
    await run_tool(stub, "login", arguments)
    await run_tool(stub, "run_command", {"command": "ls", "env": {"DB_PASSWORD": "pw-SECRET"}})

    records = await _records(server)
    stored = json.dumps([r.as_dict() for r in records])
    assert "SECRET" not in stored
    assert "SECRET" not in log_lines.getvalue()
    shown = json.loads(records[0].arguments)
    assert shown["options"]["hosts"] == [{"name": "db", "api_key": "<redacted>"}]
    assert shown["options"]["headers"] == {"Authorization": "<redacted>"}
    assert shown["options"]["note"] == "n" * 1000 + "…[+2000 chars]"


async def test_a_tool_can_choose_what_its_record_shows(server, stub) -> None:
    events = await run_tool(stub, "paste", {"text": "my diary"})

    assert "SECRET-FRAGMENT" in events[-1].result.output  # the model gets it
    [record] = await _records(server)
    assert json.loads(record.arguments) == {"text": "<8 chars>"}
    assert record.result == "paste created"


async def test_refused_calls_are_recorded_with_their_outcome(server, stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await run_tool(stub, "no_such_tool", {})
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await run_tool(stub, "login", {"user": "ann"})
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    records = await _records(server)
    assert [(r.tool, r.outcome) for r in records] == [("no_such_tool", "invalid"),
                                                      ("login", "invalid")]
    assert "unknown tool" in records[0].detail
    assert records[1].run_id == ""


async def test_outcomes_of_runs(server, stub) -> None:
    await run_tool(stub, "fails")
    await run_tool(stub, "crashes")

    failed, crashed = await _records(server)
    assert failed.outcome == "failed"
    assert "the backend said no" in failed.detail
    assert crashed.outcome == "error"
    assert "boom" not in crashed.detail  # user-safe detail only


async def test_a_cancelled_call_and_an_expired_deadline(server, stub) -> None:
    request = tool_service_pb2.ExecuteRequest(tool_name="waits")
    call = stub.Execute(request)
    async for _ in call:  # the run has started once the first event arrives
        break
    call.cancel()
    # The critic ends the run at the caller's deadline (Result{TIMEOUT}) unless the
    # transport's DEADLINE_EXCEEDED gets there first; either way the record says timeout.
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for _ in stub.Execute(request, timeout=0.5):
            pass

    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))

    async def both_written() -> bool:
        await audit.writer.flush()
        return len(await audit.writer.store.query(Query())) >= 2

    # The server notices a gone client on its own schedule.
    await eventually(both_written, within=WAIT, interval=0.05, what="both calls' records")
    records = await _records(server)
    assert sorted(r.outcome for r in records) == ["cancelled", "timeout"]
    assert all(r.tool == "waits" and r.run_id for r in records)


async def test_a_record_waits_to_share_its_commit_only_on_a_busy_server(
        server, stub, monkeypatch: pytest.MonkeyPatch) -> None:
    # How each record reaches the writer: alone (no other call open: committed at once),
    # queued (the next turn of the loop), or told that more are coming (a busy server: it
    # waits, bounded, for the records of the calls ending next).
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    writer, handed = audit.writer, []
    submit, submit_alone = writer.submit, writer.submit_alone

    def spied_submit(record: AuditRecord, *, more_coming: bool = False) -> Any:
        handed.append((record.tool, "more coming" if more_coming else "queued"))
        return submit(record, more_coming=more_coming)

    def spied_submit_alone(record: AuditRecord) -> Any:
        handed.append((record.tool, "alone"))
        return submit_alone(record)

    monkeypatch.setattr(writer, "submit", spied_submit)
    monkeypatch.setattr(writer, "submit_alone", spied_submit_alone)
    now = [0.0]  # the interceptor's clock: when each record reaches it
    monkeypatch.setattr(audit, "_clock", lambda: now[0])

    async def held() -> grpc.aio.UnaryStreamCall:
        call = stub.Execute(tool_service_pb2.ExecuteRequest(tool_name="waits"))
        async for _ in call:  # the run has started once the first event arrives
            break
        return call

    login = {"user": "ann", "password": "pw"}
    results = [await run_tool(stub, "login", login)]
    calls = [await held()]
    results.append(await run_tool(stub, "login", login))  # one other call open
    calls += [await held() for _ in range(BUSY_EXECUTES - 1)]
    # Many streams held open, but no record has come for a while: nothing says another
    # call ends soon, so this one does not wait.
    now[0] = 60.0
    results.append(await run_tool(stub, "login", login))
    # A busy server with records arriving (the one before came a moment ago): its Result
    # comes once its record is committed, after the wait.
    now[0] += writer.group_wait / 2
    results.append(await run_tool(stub, "login", login))
    # Records of other calls (a monitor polling, say) say nothing of Executes ending.
    now[0] = 120.0
    await stub.ListTools(tool_service_pb2.ListToolsRequest())
    now[0] += writer.group_wait / 2
    results.append(await run_tool(stub, "login", login))
    for call in calls:
        call.cancel()
    records = await _records(server)

    assert all(events[-1].result.outcome == events_pb2.OUTCOME_OK for events in results)
    assert [how for tool, how in handed if tool == "login"] == [
        "alone", "queued", "queued", "more coming", "queued"]
    assert sorted(r.outcome for r in records) == ["cancelled"] * BUSY_EXECUTES + ["ok"] * 6


async def test_a_lone_surrogate_is_refused_in_arguments_and_kept_escaped_elsewhere(
        server, stub) -> None:
    # "\ud800" in a caller's JSON decodes to a string with no UTF-8 form: the arguments are
    # refused. A tool's output can still hold one (a file name read with surrogateescape):
    # it goes out, and into the audit, as its escape — such a record had made the store
    # refuse its batch, retried forever, with every record queued behind it.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stub.Execute(tool_service_pb2.ExecuteRequest(
                tool_name="login", arguments_json='{"user": "\\ud800", "password": "pw"}')):
            pass
    listed = await run_tool(stub, "odd_name", {})
    after = await run_tool(stub, "login", {"user": "plain", "password": "pw"})
    records = await _records(server)

    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lone surrogate" in (refused.value.details() or "")
    assert listed[-1].result.output == "report-\\udcff.txt"
    assert [f.name for f in listed[-1].result.writeback.sent_files] == ["sent-\\xff.txt"]
    assert "found \\udcff\n" in [e.step.delta for e in listed if e.HasField("step")]
    assert after[-1].result.outcome == events_pb2.OUTCOME_OK
    assert [r.outcome for r in records] == ["invalid", "ok", "ok"]
    assert "\\udcff" in records[1].result
    report = await verify(_aiter(records), [load_key(default_key_path(
        server.settings.state_dir))])
    assert report.intact, report


async def _aiter(records: list[AuditRecord]) -> AsyncIterator[AuditRecord]:
    for record in records:
        yield record


async def test_watch_and_cancel_name_their_run(server, stub) -> None:
    events = await run_tool(stub, "login", {"user": "a", "password": "b"})
    run_id = events[-1].run_id
    watched = [r async for r in stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=run_id))]
    await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id))
    assert watched[-1].event.HasField("result")

    records = await _records(server)
    assert [r.method.rsplit("/", 1)[1] for r in records] == ["Execute", "WatchRun", "CancelRun"]
    assert {r.run_id for r in records} == {run_id}
    assert all(r.outcome == "ok" for r in records)


async def test_log_levels_and_the_bound_run_id(make_server: ServerFactory, log_lines
                                               ) -> None:
    server = await make_server(registry=_registry(), audit_log_lines="all")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        ok = await run_tool(stub, "login", {"user": "a", "password": "b"})
        privileged = await run_tool(stub, "run_command", {"command": "uptime"})
        await run_tool(stub, "fails")

    lines = _parsed(log_lines, "audit")
    assert [(line["tool"], line["level"]) for line in lines] == [
        ("login", "info"), ("run_command", "warning"), ("fails", "warning")]
    assert lines[0]["run_id"] == ok[-1].run_id
    assert lines[1]["run_id"] == privileged[-1].run_id
    assert json.loads(lines[1]["arguments"]) == {"command": "uptime"}
    assert "arguments" not in lines[0]  # only privileged calls log their arguments


async def test_by_default_only_notable_calls_get_a_log_line(server, stub, log_lines) -> None:
    ok = await run_tool(stub, "login", {"user": "a", "password": "b"})
    privileged = await run_tool(stub, "run_command", {"command": "uptime"})
    failed = await run_tool(stub, "fails")

    lines = _parsed(log_lines, "audit")
    assert [(line["run_id"], line["level"]) for line in lines] == [
        (privileged[-1].run_id, "warning"), (failed[-1].run_id, "warning")]
    # The trail has every call, the routine one too.
    records = await _records(server)
    assert [r.run_id for r in records] == [ok[-1].run_id, privileged[-1].run_id,
                                           failed[-1].run_id]


async def test_audit_log_lines_off_leaves_the_trail_whole(make_server: ServerFactory,
                                                          log_lines) -> None:
    server = await make_server(registry=_registry(), audit_log_lines="off")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        await run_tool(stub, "run_command", {"command": "uptime"})
        await run_tool(stub, "fails")

    assert _parsed(log_lines, "audit") == []
    assert [r.outcome for r in await _records(server)] == ["ok", "failed"]


def _token(sub: str, roles: list[str], **claims: Any) -> str:
    now = int(time.time())
    payload = {"sub": sub, "roles": roles, "iss": "test-issuer", "aud": "stargrpc",
               "iat": now, "nbf": now, "exp": now + 300, **claims}
    return jwt.encode(payload, JWT_SECRET, algorithm="HS256")


async def test_unauthenticated_and_denied_calls_are_recorded(make_server: ServerFactory
                                                             ) -> None:
    server = await make_server(registry=_registry(), jwt_secret=JWT_SECRET,
                               jwt_issuer="test-issuer", jwt_audience="stargrpc")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        async def execute(tool_name: str, token: str = "", **arguments: Any) -> None:
            request = tool_service_pb2.ExecuteRequest(tool_name=tool_name,
                                                      arguments_json=json.dumps(arguments))
            metadata = (("authorization", f"Bearer {token}"),) if token else None
            async for _ in stub.Execute(request, metadata=metadata):
                pass

        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await execute("ops_only")
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await execute("ops_only", _token("rita", ["reader"]))
        await execute("run_command", _token("olga", ["ops", "privileged"]), command="id")
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

    unauthenticated, refused, privileged = await _records(server)
    assert (unauthenticated.outcome, unauthenticated.principal) == ("unauthenticated", "")
    assert unauthenticated.tool == "ops_only"
    assert (refused.outcome, refused.principal, refused.tool) == ("denied", "rita", "ops_only")
    assert (privileged.outcome, privileged.principal) == ("ok", "olga")
    assert privileged.privileged is True
    assert privileged.auth_method == "jwt"


async def test_a_clean_shutdown_writes_every_record(make_server: ServerFactory) -> None:
    # Results do not wait for their records here: only the shutdown flush can save them.
    server = await make_server(registry=_registry(), audit_commit_timeout_seconds=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        runs = await asyncio.gather(*(run_tool(stub, "login", {"user": f"u{i}", "password": "p"})
                                      for i in range(40)))
    await server.stop(grace=5)

    store = open_store(default_store_url(server.settings.state_dir))
    await store.open()
    try:
        records = [r async for r in store.scan()]
        key = load_key(default_key_path(server.settings.state_dir))
        report = await verify(store.scan(), [key])
    finally:
        await store.aclose()
    assert {r.run_id for r in records} == {events[-1].run_id for events in runs}
    assert report.intact and report.checked == 40


async def test_a_method_that_does_not_exist_is_recorded(server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await channel.unary_unary("/stargrpc.v1.ToolService/Nope")(b"")
    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED

    [record] = await _records(server)
    assert (record.method, record.outcome) == ("/stargrpc.v1.ToolService/Nope", "invalid")


async def test_acting_for_and_the_invocation_context_are_recorded(server, stub) -> None:
    await run_tool(stub, "login", {"user": "a", "password": "b"},
                   context=tool_service_pb2.InvocationContext(
                       end_user="bob", channel="slack", trace_id="t-1",
                       labels={"team": "blue", "session_token": "SECRET"}))

    [record] = await _records(server)
    assert (record.principal, record.acting_for) == ("local", "bob")
    assert record.who == "local acting for bob"
    assert json.loads(record.invocation) == {
        "end_user": "bob", "channel": "slack", "trace_id": "t-1",
        "labels": {"team": "blue", "session_token": "<redacted>"}}


async def test_a_repeated_idempotency_key_is_recorded_as_such(server, stub) -> None:
    first = await run_tool(stub, "login", {"user": "a", "password": "b"}, idempotency_key="k")
    again = await run_tool(stub, "login", {"user": "a", "password": "b"}, idempotency_key="k")

    original, replay = await _records(server)
    assert original.run_id == replay.run_id == first[-1].run_id == again[-1].run_id
    assert replay.outcome == "ok"
    assert "replayed" in replay.detail


async def test_records_go_to_postgresql_when_configured(make_server: ServerFactory) -> None:
    async with pg_schema() as url:
        server = await make_server(registry=_registry(), audit_store=url)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            events = await run_tool(stub, "login", {"user": "a", "password": "b"})
        await server.stop(grace=5)

        store = open_store(url)
        await store.open()
        try:
            [record] = [r async for r in store.scan()]
        finally:
            await store.aclose()
    assert (record.run_id, record.outcome) == (events[-1].run_id, "ok")


def test_an_unknown_store_is_refused_with_the_settings() -> None:
    with pytest.raises(ValueError, match="sqlite:///PATH or postgresql://"):
        Settings(audit_store="mysql://db/audit")


def test_the_store_password_is_masked_in_the_logged_settings() -> None:
    shown = Settings(audit_store="postgresql://audit:s3cret@db:5432/audit").masked()

    assert shown["audit_store"] == "postgresql://audit:***@db:5432/audit"


async def test_a_call_whose_handler_never_ran_is_still_recorded(tmp_path: Any) -> None:
    # grpc.aio skips the handler of a call cancelled before its request arrived; the
    # interceptor ran, so the record must still be written when the call's task ends.
    settings = Settings.load(state_dir=tmp_path, insecure_no_auth=True)
    audit = AuditInterceptor(settings)
    await audit.start()

    async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return grpc.unary_stream_rpc_method_handler(lambda request, context: iter(()))

    class Details(grpc.HandlerCallDetails):
        method = EXECUTE
        invocation_metadata = ()

    handler = await asyncio.create_task(audit.intercept_service(continuation, Details()))
    assert handler is not None  # wrapped, and never run
    await asyncio.sleep(0)  # the ended task's callbacks run on the next turn of the loop
    await audit.writer.flush()
    await audit.aclose()

    store = open_store(default_store_url(tmp_path))
    await store.open()
    try:
        [record] = await store.query(Query())
    finally:
        await store.aclose()
    assert (record.method, record.outcome) == (EXECUTE, "cancelled")
    assert record.detail == "the call ended before its handler ran"


async def test_a_call_whose_record_fails_to_begin_is_still_recorded(
        server, stub, monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever goes wrong once the handler runs — even noting what the request names —
    # the call ends with its record written, and later calls still commit theirs at once.
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    original = AuditInterceptor.begin

    def broken(self: AuditInterceptor, *args: Any) -> None:
        raise RuntimeError("the peer could not be read")

    monkeypatch.setattr(AuditInterceptor, "begin", broken)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await run_tool(stub, "login", {"user": "ann", "password": "pw"})
    monkeypatch.setattr(AuditInterceptor, "begin", original)
    await run_tool(stub, "login", {"user": "bob", "password": "pw"})

    assert failed.value.code() == grpc.StatusCode.UNKNOWN
    records = await _records(server)
    assert [r.outcome for r in records] == ["error", "ok"]
    assert audit._open_calls == 0
