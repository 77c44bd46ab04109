"""A call that finds its lane full waits in the lane's queue (over gRPC, one server: its
lanes in memory, in Redis, in a Redis Cluster)."""

from __future__ import annotations

import contextlib

import grpc

from stargrpc.v1 import events_pb2, tool_service_pb2
from tests.helpers import eventually
from tests.lanes.conftest import LaneServer
from tests.lanes.lane_helpers import (
    Holds,
    fan_registry,
    first_notice,
    hold_request,
    next_event,
    started,
    stub_for,
)
from tests.runs_support import as_principal, collect, key

ALICE = as_principal("alice")
BOB = as_principal("bob")


async def test_a_full_lane_queues_the_call_tells_its_place_then_starts_it(
        lanes_at: LaneServer, holds: Holds) -> None:
    _, channel = await lanes_at()
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    assert (await next_event(first)).step.phase == events_pb2.STEP_PHASE_START
    await started(holds, 1)

    second = stub.Execute(hold_request("b"), metadata=ALICE)
    notice_b = await first_notice(second)
    third = stub.Execute(hold_request("c"), metadata=BOB)
    notice_c = await first_notice(third)
    assert (notice_b.queued.lane, notice_b.queued.position) == ("slow", 1)
    assert (notice_c.queued.lane, notice_c.queued.position) == ("slow", 2)

    holds.release("a")
    assert (await collect(first))[-1].result.outcome == events_pb2.OUTCOME_OK
    # b starts; c moves up to position 1 and is told so.
    assert (await next_event(second)).step.phase == events_pb2.STEP_PHASE_START
    moved = await first_notice(third)
    assert moved.queued.position == 1
    holds.release("b", "c")
    events_b = await collect(second)
    assert events_b[-1].result.outcome == events_pb2.OUTCOME_OK
    assert events_b[-1].result.usage.queued_seconds > 0
    events_c = await collect(third)
    assert events_c[0].step.phase == events_pb2.STEP_PHASE_START
    assert events_c[-1].result.outcome == events_pb2.OUTCOME_OK
    assert await started(holds, 3) == ["a", "b", "c"]


async def test_a_cancelled_queued_call_leaves_the_queue_and_never_runs(
        lanes_at: LaneServer, holds: Holds) -> None:
    _, channel = await lanes_at()
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    second = stub.Execute(hold_request("b"), metadata=ALICE)
    await first_notice(second)
    second.cancel()

    # The server learns of the cancel a moment later (a slot freed before then may still go
    # to b, which then stops at once): its run ends CANCELLED, out of the queue.
    async def b_ended() -> bool:
        page = await stub.ListRuns(tool_service_pb2.ListRunsRequest(
            lane="slow", state=tool_service_pb2.RUN_STATE_FINISHED), metadata=ALICE)
        return [run.outcome for run in page.runs] == [events_pb2.OUTCOME_CANCELLED]

    await eventually(b_ended, within=20, interval=0.02, what="the cancelled call's run ended")
    third = stub.Execute(hold_request("c"), metadata=ALICE)
    notice = await first_notice(third)
    assert notice.queued.position == 1
    holds.release("a", "c")
    await collect(first)
    events = await collect(third)
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert "b" not in holds.started


async def test_the_callers_deadline_applies_while_queued(lanes_at: LaneServer,
                                                        holds: Holds) -> None:
    _, channel = await lanes_at()
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    # With a key the run outlives its stream: only the deadline, applied by the server, can
    # end it. Its Result may reach the stream after the client gave up: it is read back.
    late = stub.Execute(hold_request("b", idempotency_key=key()), metadata=ALICE,
                        timeout=1.0)
    queued = await next_event(late)
    assert queued.notice.code == "QUEUED"
    with contextlib.suppress(grpc.aio.AioRpcError):
        await collect(late)
    events = await collect(stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=queued.run_id),
                                         metadata=ALICE, timeout=30))
    result = events[-1].result
    assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_TIMEOUT,
                                                   "CLIENT_DEADLINE")
    assert not any(event.HasField("step") for event in events)  # it never started
    holds.release("a")
    assert (await collect(first))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert holds.started == ["a"]


async def test_the_critic_times_a_run_from_its_start_not_from_its_queueing(
        lanes_at: LaneServer, holds: Holds) -> None:
    # Waiting longer than the hard cap in the queue does not count against the run.
    _, channel = await lanes_at(critic_hard_timeout=2.0, critic_soft_timeout=1.0)
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    second = stub.Execute(hold_request("b"), metadata=ALICE)
    notice = await first_notice(second)
    assert notice.queued.position == 1
    # a runs out its own clock (no progress for 1 s); b waited for it meanwhile.
    assert (await collect(first))[-1].result.error.code == "CRITIC_NO_PROGRESS"
    start = await next_event(second)
    assert start.step.phase == events_pb2.STEP_PHASE_START
    assert start.critic_time_left.ToMilliseconds() > 500  # its own soft timeout, afresh
    holds.release("b")
    result = (await collect(second))[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert result.usage.queued_seconds >= 0.9


async def test_cancel_run_removes_a_queued_run(lanes_at: LaneServer, holds: Holds) -> None:
    _, channel = await lanes_at()
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    queued = await stub.StartRun(start_request("b"), metadata=ALICE)
    third = stub.Execute(hold_request("c"), metadata=BOB)
    assert (await first_notice(third)).queued.position == 2
    reply = await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=queued.run_id),
                                 metadata=ALICE)
    assert reply.cancelled
    watched = await collect(stub.WatchRun(
        tool_service_pb2.WatchRunRequest(run_id=queued.run_id), metadata=ALICE))
    assert watched[0].notice.code == "QUEUED"
    assert (watched[-1].result.outcome, watched[-1].result.error.code) == (
        events_pb2.OUTCOME_CANCELLED, "CANCELLED")
    assert (await first_notice(third)).queued.position == 1
    holds.release("a", "c")
    await collect(first)
    assert (await collect(third))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert holds.started == ["a", "c"]


async def test_an_idempotent_retry_of_a_queued_call_attaches_to_it(
        lanes_at: LaneServer, holds: Holds) -> None:
    _, channel = await lanes_at(lanes={"slow": {"max_concurrent": 1, "max_queued": 1}})
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    queued = stub.Execute(hold_request("b", idempotency_key="k1"), metadata=ALICE)
    notice = await first_notice(queued)
    # The queue is full, yet the retry is no new run: it attaches (no LANE_FULL).
    retry = stub.Execute(hold_request("b", idempotency_key="k1"), metadata=ALICE)
    again = await first_notice(retry)
    assert again == notice
    holds.release("a", "b")
    await collect(first)
    first_events, retry_events = await collect(queued), await collect(retry)
    assert first_events[-1].run_id == retry_events[-1].run_id
    assert retry_events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert holds.started == ["a", "b"]


async def test_start_run_queues_the_same_way(lanes_at: LaneServer, holds: Holds) -> None:
    _, channel = await lanes_at()
    stub = stub_for(channel)
    first = await stub.StartRun(start_request("a"), metadata=ALICE)
    await started(holds, 1)
    second = await stub.StartRun(start_request("b"), metadata=ALICE)
    watch = stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=second.run_id),
                          metadata=ALICE)
    assert (await first_notice(watch)).queued.position == 1
    holds.release("a", "b")
    events = await collect(watch)
    assert events[0].step.phase == events_pb2.STEP_PHASE_START
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert first.run_id != second.run_id


def start_request(name: str, **fields: object) -> tool_service_pb2.StartRunRequest:
    request = tool_service_pb2.StartRunRequest(tool_name="hold", **fields)  # type: ignore[arg-type]
    request.arguments_json = f'{{"name": "{name}"}}'
    return request


async def test_list_runs_shows_queued_runs_with_lane_priority_and_position(
        lanes_at: LaneServer, holds: Holds) -> None:
    _, channel = await lanes_at()
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    second = stub.Execute(hold_request("b", priority=2), metadata=ALICE)
    await first_notice(second)
    third = stub.Execute(hold_request("c"), metadata=ALICE)
    await first_notice(third)

    expected = {(tool_service_pb2.RUN_STATE_RUNNING, 0, 0, "slow"),
                (tool_service_pb2.RUN_STATE_QUEUED, 1, 2, "slow"),
                (tool_service_pb2.RUN_STATE_QUEUED, 2, 0, "slow")}
    seen: list[list[tuple[int, int, int, str]]] = []

    async def listed_all() -> bool:
        # A fleet lists a run once its first events reach Redis (a moment after admission),
        # and a replica learns a move of its run's place at its next look (50 ms).
        listed = await stub.ListRuns(tool_service_pb2.ListRunsRequest(), metadata=ALICE)
        seen.append(sorted((run.state, run.queue_position, run.priority, run.lane)
                           for run in listed.runs))
        return len(seen[-1]) == 3 and set(seen[-1]) == expected

    await eventually(listed_all, what=lambda: f"the three runs listed: {seen[-1]}")
    queued = await stub.ListRuns(tool_service_pb2.ListRunsRequest(
        state=tool_service_pb2.RUN_STATE_QUEUED), metadata=ALICE)
    assert sorted(run.queue_position for run in queued.runs) == [1, 2]
    running = await stub.ListRuns(tool_service_pb2.ListRunsRequest(
        state=tool_service_pb2.RUN_STATE_RUNNING), metadata=ALICE)
    assert [run.state for run in running.runs] == [tool_service_pb2.RUN_STATE_RUNNING]
    # Another caller sees none of them.
    assert not (await stub.ListRuns(tool_service_pb2.ListRunsRequest(), metadata=BOB)).runs

    holds.release("a", "b", "c")
    for call in (first, second, third):
        await collect(call)
    done = await stub.ListRuns(tool_service_pb2.ListRunsRequest(), metadata=ALICE)
    assert {run.state for run in done.runs} == {tool_service_pb2.RUN_STATE_FINISHED}


async def test_children_in_their_parents_full_lane_run_within_its_slot(
        lanes_at: LaneServer) -> None:
    # A lane of one slot, held by a parent that waits for three children of the same lane:
    # queued behind their own parent, they would wait for ever (the parent leaves its slot
    # only when they are done). They run within the parent's slot instead.
    _, channel = await lanes_at(registry=fan_registry())
    request = tool_service_pb2.ExecuteRequest(tool_name="fan", arguments_json='{"children": 3}')
    events = await collect(stub_for(channel).Execute(request, metadata=ALICE, timeout=30))
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result
    assert events[-1].result.output == "fanned 3"
    assert events[-1].result.usage.child_runs == 3
    assert not [e for e in events if e.HasField("notice") and e.notice.code == "QUEUED"]


async def test_a_child_named_by_parent_run_id_runs_within_its_running_parents_slot(
        lanes_at: LaneServer, holds: Holds) -> None:
    # The agent's pattern: its run (a parent) holds the lane's one slot and calls the
    # service again for a child of the same lane, naming the parent. Queued behind its own
    # parent, the child would wait for ever; it runs within the parent's slot instead,
    # while an unrelated call queues.
    _, channel = await lanes_at()
    stub = stub_for(channel)
    parent = stub.Execute(hold_request("parent"), metadata=ALICE)
    parent_id = (await next_event(parent)).run_id
    await started(holds, 1)
    other = stub.Execute(hold_request("other"), metadata=BOB)
    assert (await first_notice(other)).queued.position == 1
    child = stub.Execute(hold_request("child", parent_run_id=parent_id), metadata=ALICE)
    first = await next_event(child)
    assert first.step.phase == events_pb2.STEP_PHASE_START, first
    assert await started(holds, 2) == ["parent", "child"]
    holds.release("child")
    assert (await collect(child))[-1].result.outcome == events_pb2.OUTCOME_OK
    holds.release("parent")
    assert (await collect(parent))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert (await started(holds, 3))[2] == "other"
    holds.release("other")
    assert (await collect(other))[-1].result.outcome == events_pb2.OUTCOME_OK


async def test_a_child_of_a_queued_parent_queues_too(lanes_at: LaneServer,
                                                     holds: Holds) -> None:
    # A parent still waiting for a slot holds none: its child has no slot to run in.
    _, channel = await lanes_at()
    stub = stub_for(channel)
    running = stub.Execute(hold_request("running"), metadata=BOB)
    await started(holds, 1)
    parent = stub.Execute(hold_request("parent"), metadata=ALICE)
    queued = await next_event(parent)
    assert queued.notice.code == "QUEUED" and queued.notice.queued.position == 1, queued
    parent_id = queued.run_id
    child = stub.Execute(hold_request("child", parent_run_id=parent_id), metadata=ALICE)
    assert (await first_notice(child)).queued.position == 2
    holds.release("running")
    assert (await collect(running))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert await started(holds, 2) == ["running", "parent"]
    holds.release("parent")  # the child still waits for the slot its parent holds
    assert (await collect(parent))[-1].result.outcome == events_pb2.OUTCOME_OK
    ended = (await collect(child))[-1].result
    assert (ended.outcome, ended.error.code) == (events_pb2.OUTCOME_CANCELLED,
                                                 "PARENT_RUN_ENDED")
    assert "child" not in holds.started


async def test_an_admin_hanging_a_child_under_anothers_running_run_queues(
        lanes_at: LaneServer, holds: Holds) -> None:
    # An admin may hang a child under Alice's run (a watcher may not: NOT_FOUND, as in
    # tests/test_tree_parents.py); it gets no slot from Alice's run (else another principal
    # could run past the lane's limit in her slot).
    _, channel = await lanes_at()
    stub = stub_for(channel)
    parent = stub.Execute(hold_request("parent"), metadata=ALICE)
    parent_id = (await next_event(parent)).run_id
    await started(holds, 1)
    admin = as_principal("carol", "admin")
    child = stub.Execute(hold_request("child", parent_run_id=parent_id), metadata=admin)
    queued = await next_event(child)
    assert queued.notice.code == "QUEUED" and queued.notice.queued.position == 1, queued
    await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=queued.run_id),
                         metadata=admin)
    ended = (await collect(child))[-1].result
    assert ended.outcome == events_pb2.OUTCOME_CANCELLED, ended
    holds.release("parent")
    assert (await collect(parent))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert holds.started == ["parent"]
