"""What a lane refuses before a run starts, and hostile input: each a precise status, the
server serving on."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from stargrpc import metrics
from stargrpc.v1 import events_pb2
from tests.helpers import status_details
from tests.lanes.conftest import LaneServer
from tests.lanes.lane_helpers import (
    Holds,
    first_notice,
    hold_request,
    nap_request,
    next_event,
    started,
    stub_for,
)
from tests.runs_support import as_principal, collect

ALICE = as_principal("alice")
ROOT = as_principal("root", "admin")


def refusals(lane: str, reason: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "stargrpc_lane_refusals_total", {"lane": lane, "reason": reason})
    return value or 0.0


def detail(error: grpc.aio.AioRpcError, kind: type) -> object:
    return next(d for d in status_details(error) if isinstance(d, kind))


async def test_a_full_queue_answers_lane_full_and_counts_it(lanes_at: LaneServer,
                                                           holds: Holds) -> None:
    _, channel = await lanes_at(lanes={"slow": {"max_concurrent": 1, "max_queued": 1}})
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    second = stub.Execute(hold_request("b"), metadata=ALICE)
    await first_notice(second)
    before = refusals("slow", "lane_full")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(stub.Execute(hold_request("c"), metadata=ALICE))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = detail(refused.value, error_details_pb2.ErrorInfo)
    assert info.reason == "LANE_FULL" and info.metadata["lane"] == "slow"
    # No run of the lane has ended: the estimate is how long "a" has run so far, a few
    # milliseconds; a caller is still told to wait a second, not to retry in a tight loop.
    delay = detail(refused.value, error_details_pb2.RetryInfo).retry_delay
    assert delay.ToTimedelta().total_seconds() >= 1.0
    assert refusals("slow", "lane_full") == before + 1
    holds.release("a", "b")
    assert (await collect(first))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert (await collect(second))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert "c" not in holds.started


async def test_a_wait_estimated_longer_than_max_wait_answers_lane_busy(
        lanes_at: LaneServer) -> None:
    _, channel = await lanes_at()
    stub = stub_for(channel)
    # The lane's history: runs of about 0.3 s.
    for _ in range(2):
        await collect(stub.Execute(nap_request(0.3), metadata=ALICE))
    # Longer runs now: the lane stays full while the test looks.
    running = stub.Execute(nap_request(1.0), metadata=ALICE)
    assert (await next_event(running)).HasField("step")
    queued = stub.Execute(nap_request(1.0), metadata=ALICE)
    assert (await first_notice(queued)).queued.estimated_wait.ToMilliseconds() > 0
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(stub.Execute(nap_request(0.3, max_wait_seconds=0.1), metadata=ALICE))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = detail(refused.value, error_details_pb2.ErrorInfo)
    assert info.reason == "LANE_BUSY"
    estimate = float(info.metadata["estimated_wait_seconds"])
    assert 0.1 < estimate < 5
    retry = detail(refused.value, error_details_pb2.RetryInfo)
    assert retry.retry_delay.ToMilliseconds() == pytest.approx(estimate * 1000, abs=1)
    # One that may wait long enough queues.
    patient = stub.Execute(nap_request(0.3, max_wait_seconds=30), metadata=ALICE)
    for call in (running, queued, patient):
        assert (await collect(call))[-1].result.outcome == events_pb2.OUTCOME_OK


async def test_a_run_refused_lane_busy_takes_no_turn(lanes_at: LaneServer,
                                                     holds: Holds) -> None:
    """Alice's refused entry gives its turn back: her next run keeps the turn it would have
    had, ahead of Bob's second (in Redis the entry was made before its estimate refused it;
    one process refuses before any turn is taken)."""
    _, channel = await lanes_at()
    stub = stub_for(channel)
    bob = as_principal("bob")
    running = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    b1 = stub.Execute(hold_request("b1"), metadata=ALICE)
    assert (await first_notice(b1)).queued.position == 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        # The running run's time so far is the estimate (no history): above 1 ms by now.
        await collect(stub.Execute(hold_request("b2", max_wait_seconds=0.001),
                                   metadata=ALICE))
    assert detail(refused.value, error_details_pb2.ErrorInfo).reason == "LANE_BUSY"
    b3 = stub.Execute(hold_request("b3"), metadata=ALICE)
    assert (await first_notice(b3)).queued.position == 2
    c1 = stub.Execute(hold_request("c1"), metadata=bob)
    assert (await first_notice(c1)).queued.position == 2  # Bob's first turn: beside b1's
    c2 = stub.Execute(hold_request("c2"), metadata=bob)
    # Bob's second turn is b3's: b3 arrived first. Had b2 kept its turn, b3 would have had
    # Alice's third and c2 would be third, not fourth.
    assert (await first_notice(c2)).queued.position == 4
    order = ["a", "b1", "c1", "b3", "c2"]
    calls = dict(zip(order, [running, b1, c1, b3, c2], strict=True))
    for i, name in enumerate(order):
        assert (await started(holds, i + 1))[i] == name
        holds.release(name)
        assert (await collect(calls[name]))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert "b2" not in holds.started


async def test_the_estimate_is_within_half_of_the_actual_wait(lanes_at: LaneServer) -> None:
    """A lane of one slot whose runs take 0.4 s: the third queued run's estimate at entry
    is within ±50 % of how long it then waits (its usage's queued_seconds)."""
    _, channel = await lanes_at()
    stub = stub_for(channel)
    for _ in range(3):
        await collect(stub.Execute(nap_request(0.4), metadata=ALICE))
    calls = [stub.Execute(nap_request(0.4), metadata=ALICE)]
    assert (await next_event(calls[0])).HasField("step")
    for position in (1, 2, 3):  # one after another: each is admitted before the next
        calls.append(stub.Execute(nap_request(0.4), metadata=ALICE))
        notice = await first_notice(calls[-1])
        # (fewer when the first run ended meanwhile, on a slow machine)
        assert 1 <= notice.queued.position <= position
    estimate = notice.queued.estimated_wait.ToNanoseconds() / 1e9
    results = [(await collect(call))[-1].result for call in calls]
    waited = results[-1].usage.queued_seconds
    assert 0.5 * waited <= estimate <= 1.5 * waited, (estimate, waited)


@pytest.mark.parametrize(("fields", "field", "reason"), [
    ({"priority": -1}, "priority", "INVALID_ARGUMENT"),
    ({"priority": 10**6}, "priority", "INVALID_ARGUMENT"),
    ({"max_wait_seconds": -0.5}, "max_wait_seconds", "INVALID_ARGUMENT"),
    ({"max_wait_seconds": float("nan")}, "max_wait_seconds", "INVALID_ARGUMENT"),
    ({"max_wait_seconds": float("inf")}, "max_wait_seconds", "INVALID_ARGUMENT"),
    ({"lane": "nope"}, "lane", "LANE_UNKNOWN"),
    ({"lane": "x" * 10_000}, "lane", "LANE_UNKNOWN"),
    ({"lane": "../\x00"}, "lane", "LANE_UNKNOWN"),
])
async def test_bad_lane_fields_are_invalid_arguments_and_the_server_serves_on(
        lane_server: LaneServer, holds: Holds, fields: dict[str, object], field: str,
        reason: str) -> None:
    _, channel = await lane_server()
    stub = stub_for(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(stub.Execute(hold_request("x", **fields), metadata=ROOT))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail(refused.value, error_details_pb2.ErrorInfo).reason == reason
    violations = detail(refused.value, error_details_pb2.BadRequest).field_violations
    assert [v.field for v in violations] == [field]
    assert len(refused.value.details()) < 400
    holds.release("ok")
    events = await collect(stub.Execute(hold_request("ok"), metadata=ALICE))
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK


async def test_naming_a_lane_needs_the_override_role(lanes_at: LaneServer,
                                                    holds: Holds) -> None:
    _, channel = await lanes_at(lanes={"webhooks": {"max_concurrent": 1}})
    stub = stub_for(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(stub.Execute(hold_request("x", lane="webhooks"), metadata=ALICE))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert detail(refused.value, error_details_pb2.ErrorInfo).reason == \
        "LANE_OVERRIDE_NOT_ALLOWED"
    # The admin (lane_override_role by default) may: a run held in "slow" does not stop it.
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    holds.release("w")
    routed = await collect(stub.Execute(hold_request("w", lane="webhooks"), metadata=ROOT))
    assert routed[0].step.phase == events_pb2.STEP_PHASE_START  # not queued behind "a"
    assert routed[-1].result.outcome == events_pb2.OUTCOME_OK
    holds.release("a")
    await collect(first)


async def test_a_callers_priority_is_capped_unless_admin(lanes_at: LaneServer,
                                                        holds: Holds) -> None:
    _, channel = await lanes_at(priority_max_per_principal=2)
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    capped = stub.Execute(hold_request("b", priority=9), metadata=ALICE)
    assert (await first_notice(capped)).queued.priority == 2
    tool_default = stub.Execute(hold_request("c", tool_name="hold_urgent"), metadata=ALICE)
    assert (await first_notice(tool_default)).queued.priority == 3
    admin = stub.Execute(hold_request("d", priority=9), metadata=ROOT)
    notice = await first_notice(admin)
    assert (notice.queued.priority, notice.queued.position) == (9, 1)
    holds.release("a", "b", "c", "d")
    for call in (first, capped, tool_default, admin):
        assert (await collect(call))[-1].result.outcome == events_pb2.OUTCOME_OK
    # Higher priority first: d (9), c (3), b (2).
    assert holds.started == ["a", "d", "c", "b"]



async def test_one_principals_flood_is_capped_and_does_not_hold_back_another(
        lanes_at: LaneServer, holds: Holds) -> None:
    """A queued run holds its caller's place under max_concurrent_runs_per_principal: a
    flooding caller is refused past it (CONCURRENCY_LIMIT) before it can fill the lane's
    queue, and another caller's run takes its turn next."""
    _, channel = await lanes_at(max_concurrent_runs_per_principal=5)
    stub = stub_for(channel)
    flood = [stub.Execute(hold_request(f"f{i}"), metadata=ALICE) for i in range(5)]
    firsts = [await next_event(call) for call in flood]
    assert sorted(event.WhichOneof("kind") for event in firsts) == ["notice"] * 4 + ["step"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(stub.Execute(hold_request("f5"), metadata=ALICE))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert detail(refused.value, error_details_pb2.ErrorInfo).reason == "CONCURRENCY_LIMIT"
    bob = stub.Execute(hold_request("b"), metadata=as_principal("bob"))
    assert (await first_notice(bob)).queued.position == 2  # behind f1 only, not f4
    holds.release(*[f"f{i}" for i in range(5)], "b")
    for call in [*flood, bob]:
        assert (await collect(call))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert holds.started.index("b") == 2
