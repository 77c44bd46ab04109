"""ApproveRun under attack and bad input: each refusal a precise status, recorded in the
audit trail, and the waiting run (and the server) undisturbed — it is approved properly at
the end and runs once."""

from __future__ import annotations

import asyncio
import base64
import binascii
import secrets
from typing import Any

import grpc
from google.rpc import error_details_pb2

from stargrpc import ToolContext, tool
from stargrpc.registry import NoArguments, Registry, spec_of
from stargrpc.v1 import events_pb2, tool_service_pb2
from tests.approval.approval_helpers import (
    BODIES_RUN,
    approve_request,
    execute_request,
    people_of,
    read_until_approval,
    rest_of,
)
from tests.helpers import key_channel, records_of, status_details


async def refusal(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str], list[str]]:
    """The status code, ErrorInfo reason and metadata, and BadRequest fields of a call that
    must fail."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        details = status_details(error)
        info = next((d for d in details if isinstance(d, error_details_pb2.ErrorInfo)), None)
        fields = [v.field for d in details if isinstance(d, error_details_pb2.BadRequest)
                  for v in d.field_violations]
        return (error.code(), info.reason if info else "", dict(info.metadata) if info else {},
                fields)
    raise AssertionError("the call was not refused")


async def test_each_attack_is_refused_precisely_audited_and_disturbs_nothing(
        auth, people) -> None:
    alice_call = people.alice.Execute(execute_request("deploy", {"service": "a"}))
    head, approval = await read_until_approval(alice_call)
    run_id, approval_id = head[0].run_id, approval.approval_id
    other_call = people.alice.Execute(execute_request("deploy", {"service": "b"}))
    other_head, other = await read_until_approval(other_call)
    bob_call = people.bob.Execute(execute_request("deploy", {"service": "bob's"}))
    bob_head, bobs = await read_until_approval(bob_call)
    plain = await people.bob.StartRun(tool_service_pb2.StartRunRequest(tool_name="greet"))

    # A forged approval id, and one replayed from another run.
    assert await refusal(people.bob.ApproveRun(approve_request(
        run_id, secrets.token_urlsafe(24)))) == (
        grpc.StatusCode.PERMISSION_DENIED, "APPROVAL_ID_MISMATCH", {"run_id": run_id}, [])
    assert (await refusal(people.bob.ApproveRun(approve_request(
        other_head[0].run_id, approval_id))))[:2] == (
        grpc.StatusCode.PERMISSION_DENIED, "APPROVAL_ID_MISMATCH")
    # The right id with the digest of other arguments: the approver saw something else.
    code, reason, metadata, _ = await refusal(people.bob.ApproveRun(approve_request(
        run_id, approval_id, digest=other.arguments_digest)))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_DIGEST_MISMATCH")
    assert metadata["arguments_digest"] == approval.arguments_digest
    # Approving one's own run, and deciding without the role (its owner; an admin).
    assert (await refusal(people.bob.ApproveRun(approve_request(
        bob_head[0].run_id, bobs.approval_id))))[:2] == (
        grpc.StatusCode.PERMISSION_DENIED, "APPROVAL_SELF_NOT_ALLOWED")
    for stub in (people.alice, people.root):
        code, reason, metadata, _ = await refusal(stub.ApproveRun(approve_request(
            run_id, approval_id)))
        assert (code, reason, metadata["required_role"]) == (
            grpc.StatusCode.PERMISSION_DENIED, "APPROVER_ROLE_REQUIRED", "approver")
    # Another principal's run, to a caller who may not see it: as if it did not exist.
    assert (await refusal(people.mallory.ApproveRun(approve_request(
        run_id, approval_id))))[:2] == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    assert (await refusal(people.bob.ApproveRun(approve_request(
        "no-such-run", approval_id))))[:2] == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    # A run that does not wait for approval.
    assert await refusal(people.bob.ApproveRun(approve_request(
        plain.run_id, approval_id))) == (
        grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_NOT_PENDING",
        {"run_id": plain.run_id, "state": "none"}, [])

    # Malformed, missing and oversized fields.
    malformed = [
        (approve_request("", approval_id), ["run_id"]),
        (approve_request(run_id, ""), ["approval_id"]),
        (approve_request("r" * 129, approval_id), ["run_id"]),
        (approve_request(run_id, "x" * 129), ["approval_id"]),
        (approve_request(run_id, "ïd-wïth-äccents"), ["approval_id"]),
        (approve_request(run_id, approval_id, reason="r" * 1001), ["reason"]),
        (approve_request(run_id, approval_id, reason="ok\x00\x1b[2J"), ["reason"]),
        (approve_request(run_id, approval_id, digest="A" * 64), ["arguments_digest"]),
        (approve_request(run_id, approval_id, digest="abc"), ["arguments_digest"]),
        (tool_service_pb2.ApproveRunRequest(run_id=run_id, approval_id=approval_id),
         ["decision"]),
        (tool_service_pb2.ApproveRunRequest(run_id=run_id, approval_id=approval_id,
                                            decision=7), ["decision"]),  # type: ignore[arg-type]
        (tool_service_pb2.ApproveRunRequest(), ["run_id", "approval_id", "decision"]),
    ]
    for request, fields in malformed:
        code, reason, _, violated = await refusal(people.bob.ApproveRun(request))
        assert (code, violated) == (grpc.StatusCode.INVALID_ARGUMENT, fields), request
    async with key_channel(auth.target, auth.add_key("eve", "approver")) as channel:
        raw = channel.unary_unary("/stargrpc.v1.ToolService/ApproveRun")
        try:
            await raw(b"\xff\xff\xff\xff", timeout=20)
            raise AssertionError("undecodable bytes were taken")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT

    # Nothing was disturbed: the runs still wait, and the right decision is taken.
    waiting = await people.carol.ListRuns(tool_service_pb2.ListRunsRequest(
        state=tool_service_pb2.RUN_STATE_AWAITING_APPROVAL))
    assert {run.run_id for run in waiting.runs} == {
        run_id, other_head[0].run_id, bob_head[0].run_id}
    assert run_id not in BODIES_RUN
    await people.carol.ApproveRun(approve_request(run_id, approval_id,
                                                  digest=approval.arguments_digest))
    events = await rest_of(alice_call)
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert BODIES_RUN.count(run_id) == 1
    await people.alice.CancelRun(tool_service_pb2.CancelRunRequest(run_id=other_head[0].run_id))
    await people.bob.CancelRun(tool_service_pb2.CancelRunRequest(run_id=bob_head[0].run_id))
    assert (await rest_of(other_call))[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert (await rest_of(bob_call))[-1].result.outcome == events_pb2.OUTCOME_CANCELLED

    records = [r for r in await records_of(auth.server) if r.method.endswith("/ApproveRun")]
    outcomes = [r.outcome for r in records]
    # Every attempt has its record: the 5 refused PERMISSION_DENIED (two ids, the self
    # approval, two callers without the role), the 4 other refusals, the 12 malformed
    # requests and the undecodable one, and the approval.
    assert outcomes.count("denied") == 5 and outcomes.count("ok") == 1
    assert outcomes.count("invalid") == 4 + 12 + 1
    assert {r.principal for r in records if r.outcome == "denied"} == {
        "bob", "alice", "tester"}  # tester: root's key


async def test_an_approver_may_approve_its_own_run_when_allowed(make_auth_server) -> None:
    from tests.approval.approval_helpers import approval_registry, people_of

    auth = await make_auth_server(approval_registry(), approval_allow_self=True)
    async with people_of(auth) as people:
        call = people.bob.Execute(execute_request("deploy", {"service": "mine"}))
        head, approval = await read_until_approval(call)
        await people.bob.ApproveRun(approve_request(head[0].run_id, approval.approval_id))
        assert (await rest_of(call))[-1].result.output == "deployed mine to staging"


async def test_a_request_left_pending_by_an_ended_run_cannot_be_approved(auth, people) -> None:
    # As when the replica of a waiting run died: the run ended (RUN_LOST) and nobody
    # withdrew its request. A decision on it would start nothing: it is withdrawn instead.
    from stargrpc.stores.approvals import ApprovalRecord, now_ms

    ended = await people.alice.StartRun(tool_service_pb2.StartRunRequest(tool_name="greet"))
    await rest_of(people.alice.WatchRun(tool_service_pb2.WatchRunRequest(run_id=ended.run_id)))
    store = auth.server.runtime.approvals.store
    await store.put(ApprovalRecord(
        run_id=ended.run_id, approval_id="left-behind", tool="greet", owner="alice",
        principal="alice", digest="0" * 64, arguments="{}", requested_ms=now_ms(),
        deadline_ms=now_ms() + 60_000), 60_000)
    assert await refusal(people.bob.ApproveRun(approve_request(
        ended.run_id, "left-behind"))) == (
        grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_NOT_PENDING",
        {"run_id": ended.run_id, "state": "withdrawn"}, [])


async def test_a_decision_sent_again_gets_the_same_answer_and_nothing_else_does(
        auth, people) -> None:
    # The answer to a decision can be lost (a stalled store, a dropped connection) after the
    # decision was taken: the approver sends it again and must hear what was decided, once.
    call = people.alice.Execute(execute_request("deploy", {"service": "api"}))
    head, approval = await read_until_approval(call)
    run_id = head[0].run_id
    first = await people.bob.ApproveRun(approve_request(
        run_id, approval.approval_id, digest=approval.arguments_digest))
    again = await people.bob.ApproveRun(approve_request(
        run_id, approval.approval_id, digest=approval.arguments_digest))
    assert (again.run_id, again.decision, again.arguments_digest) == (
        first.run_id, first.decision, first.arguments_digest)
    events = await rest_of(call)
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert BODIES_RUN.count(run_id) == 1
    # Not the same decision: another approver, the other verdict, a guessed id.
    for stub, request in (
            (people.carol, approve_request(run_id, approval.approval_id)),
            (people.bob, approve_request(run_id, approval.approval_id, deny=True)),
            (people.bob, approve_request(run_id, secrets.token_urlsafe(24)))):
        assert await refusal(stub.ApproveRun(request)) == (
            grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_NOT_PENDING",
            {"run_id": run_id, "state": "approved"}, [])



#: Opened at the end of a test whose runs linger.
LINGERING = asyncio.Event()


@tool()
async def linger(ctx: ToolContext, args: NoArguments) -> str:
    """Runs until the test lets it end; needs nobody's approval."""
    await LINGERING.wait()
    return "done"


async def test_an_approvers_page_tokens_name_no_run_it_may_not_see(make_auth_server) -> None:
    # An approver lists every principal's runs that wait for approval, and only those; the
    # page token carried the cursor of the page's last run in plain base64 JSON — the id
    # and start of another principal's run that waits for nothing.
    LINGERING.clear()
    auth = await make_auth_server(Registry([spec_of(linger)]))  # type: ignore[misc]
    async with people_of(auth) as people:
        calls = [people.alice.Execute(execute_request("linger")) for _ in range(3)]
        runs = [(await call.read()).event.run_id for call in calls]
        tokens = []
        request = tool_service_pb2.ListRunsRequest(
            state=tool_service_pb2.RUN_STATE_AWAITING_APPROVAL, page_size=1)
        while True:
            page = await people.bob.ListRuns(request)
            assert not page.runs
            if not page.next_page_token:
                break
            tokens.append(page.next_page_token)
            request.page_token = page.next_page_token
        LINGERING.set()
        ended = [(await rest_of(call))[-1].result.outcome for call in calls]
    revealed = [run_id for token in tokens for run_id in runs
                if run_id in _every_decoding(token) or run_id in token]

    assert len(tokens) == 2 and revealed == []
    assert ended == [events_pb2.OUTCOME_OK] * 3


def _every_decoding(token: str) -> str:
    """The token's parts, each decoded from base64url where it decodes."""
    decoded = []
    for part in token.split("."):
        try:
            decoded.append(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
                           .decode("utf-8", "replace"))
        except (binascii.Error, ValueError):
            continue
    return " ".join(decoded)
