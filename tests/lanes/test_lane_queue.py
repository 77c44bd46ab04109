"""The order of a lane's queue (priority, turns between principals) and its estimated wait,
on :class:`LaneQueue` with a clock the test moves."""

from __future__ import annotations

import pytest

from stargrpc.errors import ResourceExhausted
from stargrpc.runs.lanes import LanePlace, LaneQueue, LaneTicket, estimate_wait
from stargrpc.settings import LaneConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lane(slots: int = 1, queued: int = 10_000) -> tuple[LaneQueue, Clock]:
    clock = Clock()
    return LaneQueue("work", LaneConfig(max_concurrent=slots, max_queued=queued), clock), clock


def ticket(run_id: str, principal: str = "alice", priority: int = 0,
           max_wait: float = 0.0) -> LaneTicket:
    return LaneTicket(run_id, "work", principal, priority, max_wait)


def drain_order(queue: LaneQueue, holding: list[LanePlace]) -> list[str]:
    """Ends the running runs one by one; the order in which the waiting ones start."""
    order = []
    running = list(holding)
    while running:
        place = running.pop(0)
        for granted in queue.leave(place):
            order.append(granted.ticket.run_id)
            running.append(granted)
    return order


async def test_a_free_slot_is_taken_at_once_then_runs_queue_in_arrival_order() -> None:
    queue, _ = lane(slots=2)
    first, second = queue.enter(ticket("r1")), queue.enter(ticket("r2"))
    third = queue.enter(ticket("r3"))
    assert first.granted and second.granted and not third.granted
    assert third.position == 1 and queue.depth == 1
    assert queue.leave(first) == [third] and third.granted
    assert queue.depth == 0


async def test_a_higher_priority_starts_first() -> None:
    queue, _ = lane()
    running = queue.enter(ticket("r0"))
    for i in range(3):
        queue.enter(ticket(f"low{i}", priority=1))
    urgent = queue.enter(ticket("urgent", priority=4))
    assert urgent.position == 1
    assert drain_order(queue, [running]) == ["urgent", "low0", "low1", "low2"]


async def test_one_principals_thousand_runs_do_not_hold_back_anothers_one() -> None:
    queue, _ = lane(slots=4)
    running = [queue.enter(ticket(f"r{i}", principal="flood")) for i in range(4)]
    for i in range(1000):
        queue.enter(ticket(f"flood{i}", principal="flood"))
    mine = queue.enter(ticket("mine", principal="bob"))
    assert mine.position == 2  # after the flood's first waiting run, not its 1,000th
    order = drain_order(queue, running)
    assert order.index("mine") == 1
    # Once the flood has started some, bob's next run is next in line.
    queue2, _ = lane(slots=4)
    running = [queue2.enter(ticket(f"r{i}", principal="flood")) for i in range(4)]
    for i in range(1000):
        queue2.enter(ticket(f"flood{i}", principal="flood"))
    for place in running[:2]:
        queue2.leave(place)
    assert queue2.enter(ticket("mine", principal="bob")).position == 1
    assert len(order) == 1001


async def test_principals_take_turns_within_a_priority() -> None:
    queue, _ = lane()
    running = queue.enter(ticket("r0"))
    for i in range(3):
        queue.enter(ticket(f"a{i}", principal="a"))
    for i in range(3):
        queue.enter(ticket(f"b{i}", principal="b"))
    queue.enter(ticket("c0", principal="c"))
    assert drain_order(queue, [running]) == ["a0", "b0", "c0", "a1", "b1", "a2", "b2"]


async def test_a_turn_taken_long_ago_gives_no_advantage_later() -> None:
    queue, _ = lane()
    running = queue.enter(ticket("r0", principal="a"))
    for i in range(5):
        queue.enter(ticket(f"b{i}", principal="b"))
    order = drain_order(queue, [running])
    assert order == [f"b{i}" for i in range(5)]
    # a has not queued for a while: it takes the lane's turn now (the virtual time), ahead
    # of b's later turns — but no turn it missed is kept for it: b's runs lost nothing.
    running = queue.enter(ticket("r1", principal="b"))
    queue.enter(ticket("b5", principal="b"))
    queue.enter(ticket("b6", principal="b"))
    late = queue.enter(ticket("a1", principal="a"))
    queue.enter(ticket("a2", principal="a"))
    queue.enter(ticket("a3", principal="a"))
    assert late.position == 1
    assert drain_order(queue, [running]) == ["a1", "b5", "a2", "b6", "a3"]


async def test_a_full_queue_refuses_lane_full() -> None:
    queue, _ = lane(slots=1, queued=2)
    queue.enter(ticket("r0"))
    queue.enter(ticket("r1"))
    queue.enter(ticket("r2"))
    with pytest.raises(ResourceExhausted) as refused:
        queue.enter(ticket("r3"))
    assert refused.value.reason == "LANE_FULL"
    assert refused.value.metadata == {"lane": "work", "max_queued": "2"}


async def test_the_estimate_follows_position_slots_and_recent_durations() -> None:
    queue, clock = lane(slots=2)
    assert queue.estimate(5) == 0.0  # no history, nothing running: unknown
    for _ in range(4):  # four runs of 10 s each
        place = queue.enter(ticket(f"h{_}"))
        clock.now += 10
        queue.leave(place)
    a = queue.enter(ticket("a"))
    clock.now += 4
    queue.enter(ticket("b"))
    clock.now += 2
    # a frees its slot in 4 s, b in 8 s; then one slot every 10 s per slot.
    assert queue.estimate(1) == pytest.approx(4)
    assert queue.estimate(2) == pytest.approx(8)
    assert queue.estimate(3) == pytest.approx(14)
    assert queue.estimate(4) == pytest.approx(18)
    assert a.granted


def test_estimate_wait_simulated_against_runs_of_known_duration() -> None:
    """A lane of 3 slots whose runs take 0.8 s and 1.2 s in turn (the history holds the
    same mix): each queued run's estimate is within ±50 % of when it does start."""
    durations = [0.8, 1.2] * 8
    slots = 3
    running_for = [0.2, 0.5, 0.7]
    # The true schedule: slots free as the running runs (1.0 s each) end, then each queued
    # run takes its own duration.
    free = sorted(1.0 - ran for ran in running_for)
    waits = []
    for i in range(12):
        start = free.pop(0)
        waits.append(start)
        free.append(start + durations[i])
        free.sort()
    for position, actual in enumerate(waits, start=1):
        estimate = estimate_wait(position, slots, durations, running_for)
        assert 0.5 * actual <= estimate <= 1.5 * actual, (position, estimate, actual)


async def test_max_wait_refuses_lane_busy_with_the_estimate() -> None:
    queue, clock = lane(slots=1)
    place = queue.enter(ticket("h"))
    clock.now += 3
    queue.leave(place)
    queue.enter(ticket("r0"))
    queue.enter(ticket("r1", max_wait=10))  # about 3 s: fine
    with pytest.raises(ResourceExhausted) as refused:
        queue.enter(ticket("r2", max_wait=4))  # about 6 s
    assert refused.value.reason == "LANE_BUSY"
    assert refused.value.retry_after == pytest.approx(6)
    assert queue.depth == 1  # the refused run took no place


async def test_a_waiting_run_that_leaves_is_forgotten_and_moves_the_others_up() -> None:
    queue, _ = lane()
    running = queue.enter(ticket("r0"))
    gone = queue.enter(ticket("gone"))
    stays = queue.enter(ticket("stays"))
    assert queue.leave(gone, ran=False) == []
    queue.reposition()
    assert stays.position == 1
    assert queue.leave(running) == [stays]
    assert queue.where("gone") is None and queue.where("stays") is stays
