"""Human approval through a real server: a run of a tool that needs approval waits, its
stream says what waits, an approver's yes starts it and a no ends it DENIED, nobody's
answer ends it APPROVAL_TIMEOUT, and the audit trail holds each request and decision."""

from __future__ import annotations

import hashlib
import json

import grpc

from stargrpc.runs.approval import APPROVAL_METHOD, arguments_digest
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.approval.approval_helpers import (
    BODIES_RUN,
    approval_registry,
    approve_request,
    execute_request,
    people_of,
    read_until_approval,
    rest_of,
)
from tests.helpers import eventually, key_channel, records_of

ARGUMENTS = {"target": "prod", "service": "billing", "api_token": "s3cr3t-t0ken"}


async def test_an_approved_run_starts_after_the_decision_and_both_are_audited(
        auth, people) -> None:
    call = people.alice.Execute(execute_request("deploy", ARGUMENTS))
    head, approval = await read_until_approval(call)
    run_id = head[0].run_id

    # What waits: before any step, with the digest of the canonical arguments.
    assert not [e for e in head if e.HasField("step")]
    canonical = json.dumps(ARGUMENTS, sort_keys=True, separators=(",", ":")).encode()
    assert approval.arguments_digest == hashlib.sha256(canonical).hexdigest()
    assert approval.tool_name == "deploy" and approval.principal == "alice"
    assert len(approval.approval_id) >= 32 and run_id not in approval.approval_id
    # Never "-" first (a command line would take it for an option): apv_ and random.
    assert approval.approval_id.startswith("apv_")
    assert "billing" in approval.arguments and "s3cr3t" not in approval.arguments
    assert approval.deadline.ToSeconds() - approval.requested_at.ToSeconds() == 60
    assert run_id not in BODIES_RUN

    # Approvers list what waits for them, with the arguments; alice sees her own run.
    waiting = await people.bob.ListRuns(tool_service_pb2.ListRunsRequest(
        state=tool_service_pb2.RUN_STATE_AWAITING_APPROVAL))
    [summary] = [run for run in waiting.runs if run.run_id == run_id]
    assert summary.state == tool_service_pb2.RUN_STATE_AWAITING_APPROVAL
    assert summary.principal == "alice" and summary.approval == approval
    mine = await people.alice.ListRuns(tool_service_pb2.ListRunsRequest())
    assert [r.state for r in mine.runs if r.run_id == run_id] == [
        tool_service_pb2.RUN_STATE_AWAITING_APPROVAL]
    running = await people.alice.ListRuns(tool_service_pb2.ListRunsRequest(
        state=tool_service_pb2.RUN_STATE_RUNNING))
    assert run_id not in [r.run_id for r in running.runs]
    nothing = await people.mallory.ListRuns(tool_service_pb2.ListRunsRequest(
        state=tool_service_pb2.RUN_STATE_AWAITING_APPROVAL))
    assert not nothing.runs

    answer = await people.bob.ApproveRun(approve_request(
        run_id, approval.approval_id, reason="change ticket 42",
        digest=approval.arguments_digest))
    assert answer.run_id == run_id and answer.arguments_digest == approval.arguments_digest
    assert answer.decision == tool_service_pb2.APPROVAL_VERDICT_APPROVE

    events = await rest_of(call)
    granted = [e.notice for e in events if e.notice.code == "APPROVAL_GRANTED"]
    assert [(g.approval_decision.approver, g.approval_decision.reason) for g in granted] == [
        ("bob", "change ticket 42")]
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert events[-1].result.output == "deployed billing to prod"
    assert events[-1].result.usage.queued_seconds > 0
    assert BODIES_RUN.count(run_id) == 1
    starts = [i for i, e in enumerate(events) if e.step.phase == events_pb2.STEP_PHASE_START]
    assert starts and events.index(next(e for e in events
                                        if e.notice.code == "APPROVAL_GRANTED")) < starts[0]

    # A second decision on the same request is refused: it was taken once.
    try:
        await people.carol.ApproveRun(approve_request(run_id, approval.approval_id,
                                                      deny=True))
        raise AssertionError("a second decision was taken")
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION

    records = await records_of(auth.server)
    requested = [r for r in records if r.method == APPROVAL_METHOD and r.run_id == run_id]
    assert [(r.principal, r.tool, r.outcome) for r in requested] == [("alice", "deploy", "ok")]
    assert approval.arguments_digest in requested[0].detail
    assert "s3cr3t" not in requested[0].arguments and "billing" in requested[0].arguments
    decisions = [r for r in records
                 if r.method.endswith("/ApproveRun") and r.run_id == run_id]
    assert [(r.principal, r.outcome) for r in decisions] == [("bob", "ok"), ("carol", "invalid")]
    assert "approved" in decisions[0].detail and "change ticket 42" in decisions[0].detail
    assert approval.arguments_digest in decisions[0].detail
    assert decisions[0].time > requested[0].time


async def test_a_denied_run_ends_denied_with_the_reason_and_never_runs(people) -> None:
    call = people.alice.Execute(execute_request("deploy", {"service": "db"}))
    head, approval = await read_until_approval(call)
    run_id = head[0].run_id
    await people.bob.ApproveRun(approve_request(run_id, approval.approval_id, deny=True,
                                                reason="not on a Friday"))
    events = await rest_of(call)
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_DENIED
    assert result.error.code == "APPROVAL_DENIED"
    assert result.error.message == "denied by bob: not on a Friday"
    assert not [e for e in events if e.HasField("step")]
    assert run_id not in BODIES_RUN


async def test_no_decision_in_time_ends_the_run_approval_timeout(make_auth_server) -> None:
    auth = await make_auth_server(approval_registry(), approval_timeout_seconds=0.5)
    async with people_of(auth) as people:
        started = await people.alice.StartRun(tool_service_pb2.StartRunRequest(
            tool_name="deploy", arguments_json='{"service": "web"}'))
        watch = people.alice.WatchRun(tool_service_pb2.WatchRunRequest(
            run_id=started.run_id))
        _, approval = await read_until_approval(watch)
        events = await rest_of(watch)
        assert events[-1].result.outcome == events_pb2.OUTCOME_DENIED
        assert events[-1].result.error.code == "APPROVAL_TIMEOUT"
        assert started.run_id not in BODIES_RUN
        try:  # too late
            await people.bob.ApproveRun(approve_request(started.run_id,
                                                        approval.approval_id))
            raise AssertionError("a late approval was taken")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    records = await records_of(auth.server)
    assert [r.outcome for r in records
            if r.method == APPROVAL_METHOD and r.run_id == started.run_id] == ["ok", "denied"]


async def test_a_run_cancelled_while_it_waits_withdraws_its_request(people) -> None:
    started = await people.alice.StartRun(tool_service_pb2.StartRunRequest(
        tool_name="deploy", arguments_json='{"service": "queue"}'))
    watch = people.alice.WatchRun(tool_service_pb2.WatchRunRequest(run_id=started.run_id))
    _, approval = await read_until_approval(watch)
    await people.alice.CancelRun(tool_service_pb2.CancelRunRequest(run_id=started.run_id))
    events = await rest_of(watch)
    assert events[-1].result.outcome == events_pb2.OUTCOME_CANCELLED

    async def refused() -> bool:
        try:
            await people.bob.ApproveRun(approve_request(started.run_id,
                                                        approval.approval_id))
        except grpc.aio.AioRpcError as error:
            return error.code() == grpc.StatusCode.FAILED_PRECONDITION
        return False

    # The withdrawal is written in the background as the run ends.
    await eventually(refused, what="the request withdrawn")
    assert started.run_id not in BODIES_RUN


async def test_the_policy_asks_for_destructive_tools_and_exempts_roles(
        make_auth_server) -> None:
    auth = await make_auth_server(approval_registry(), approval_policy={
        "destructive": True, "exempt_roles": ["automation"]})
    robot = auth.add_key("robot", "automation")
    async with people_of(auth) as people:
        tools = await people.alice.ListTools(tool_service_pb2.ListToolsRequest())
        assert {t.name: t.requires_approval for t in tools.tools} == {
            "deploy": True, "wipe": True, "greet": False}
        greeted = await rest_of(people.alice.Execute(execute_request("greet")))
        assert greeted[-1].result.output == "hello"
        call = people.alice.Execute(execute_request("wipe", {"path": "/tmp/x"}))
        head, approval = await read_until_approval(call)
        assert approval.tool_name == "wipe"
        await people.bob.ApproveRun(approve_request(head[0].run_id, approval.approval_id))
        assert (await rest_of(call))[-1].result.output == "wiped /tmp/x"
    async with key_channel(auth.target, robot) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await rest_of(stub.Execute(execute_request("wipe", {"path": "/tmp/y"})))
        assert events[-1].result.output == "wiped /tmp/y"
        assert not [e for e in events if e.notice.code == "APPROVAL_REQUIRED"]


def test_the_digest_is_the_canonical_json_of_the_arguments() -> None:
    assert arguments_digest({"b": 1, "a": "é"}) == hashlib.sha256(
        '{"a":"é","b":1}'.encode()).hexdigest()
    assert arguments_digest({"a": [1, {"y": 2, "x": 1}]}) == arguments_digest(
        json.loads('{ "a" : [ 1 , { "x" : 1 , "y" : 2 } ] }'))


async def test_the_callers_deadline_ends_a_waiting_run_and_a_retry_attaches(people) -> None:
    # A retry with the run's key while it waits attaches to it: the same request, the same
    # approval id, and one decision starts the run once.
    request = execute_request("deploy", {"service": "keyed"}, idempotency_key="deploy-once")
    first = people.alice.Execute(request)
    head, approval = await read_until_approval(first)
    retry = people.alice.Execute(request)
    retry_head, retried = await read_until_approval(retry)
    assert retry_head[0].run_id == head[0].run_id and retried == approval
    await people.bob.ApproveRun(approve_request(head[0].run_id, approval.approval_id))
    assert (await rest_of(first))[-1].result.output == "deployed keyed to staging"
    assert (await rest_of(retry))[-1].result.output == "deployed keyed to staging"
    assert BODIES_RUN.count(head[0].run_id) == 1

    # The critic's clock waits for the START, the caller's deadline does not: a keyed run
    # outlives its stream, so only the deadline can have ended it.
    call = people.alice.Execute(execute_request("deploy", {"service": "late"},
                                                idempotency_key="deploy-late"), timeout=1.5)
    head, approval = await read_until_approval(call)
    try:
        await rest_of(call)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    watched = await rest_of(people.alice.WatchRun(tool_service_pb2.WatchRunRequest(
        run_id=head[0].run_id)))
    result = watched[-1].result
    assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_TIMEOUT,
                                                   "CLIENT_DEADLINE")
    assert head[0].run_id not in BODIES_RUN


async def test_a_call_refused_after_its_request_was_written_withdraws_it(
        make_auth_server, tmp_path) -> None:
    """StartRun with a delivery: the request is written in admission, then making the
    delivery durable fails (the state folder cannot keep it) and the call is refused. The
    request is withdrawn at once — not left pending until its timeout — and audited so."""
    secret = tmp_path / "delivery.key"
    secret.write_bytes(b"a delivery key for tests\n")
    auth = await make_auth_server(approval_registry(), approval_timeout_seconds=600,
                                  delivery_allowlist=["127.0.0.1"],
                                  delivery_allowed_networks=["127.0.0.1/32"],
                                  delivery_webhook_secret_file=secret)
    server = auth.server
    refused_runs: list[str] = []

    def full_disk(run_id: str, tool: str, target: object) -> None:
        refused_runs.append(run_id)
        raise OSError("no space left on device")

    # The journal write is what fails (as a full disk would); the rest is the real server.
    server.service.deliveries._journal.add = full_disk
    request = tool_service_pb2.StartRunRequest(tool_name="deploy",
                                               arguments_json='{"service": "web"}')
    request.delivery.webhook.url = "https://127.0.0.1:9/hook"
    async with people_of(auth) as people:
        try:
            await people.alice.StartRun(request)
            raise AssertionError("the call was answered")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        [run_id] = refused_runs
        record = await server.runtime.approvals.store.get(run_id)
        assert record is not None and not record.pending and record.state == "withdrawn"
        listed = await people.bob.ListRuns(tool_service_pb2.ListRunsRequest(
            state=tool_service_pb2.RUN_STATE_AWAITING_APPROVAL))
        assert run_id not in [run.run_id for run in listed.runs]
    assert run_id not in BODIES_RUN
    records = await records_of(server)
    assert [r.outcome for r in records
            if r.method == APPROVAL_METHOD and r.run_id == run_id] == ["ok", "cancelled"]
