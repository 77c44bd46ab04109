"""The supervision alarms: every run's timer on one loop timer per event loop."""

from __future__ import annotations

import asyncio

from stargrpc.critic import supervision
from stargrpc.critic.supervision import _alarms


async def test_alarms_fire_in_order_and_cancelled_ones_never() -> None:
    loop = asyncio.get_running_loop()
    alarms = _alarms(loop)
    assert _alarms(loop) is alarms  # one per loop
    fired: list[str] = []
    done = asyncio.Event()
    now = loop.time()
    alarms.call_at(now + 0.03, lambda: fired.append("third"))
    alarms.call_at(now + 0.01, lambda: fired.append("first"))
    cancelled = alarms.call_at(now + 0.02, lambda: fired.append("cancelled"))
    alarms.call_at(now + 0.02, lambda: fired.append("second"))
    alarms.call_at(now + 0.04, done.set)
    cancelled.cancel()
    cancelled.cancel()  # twice is harmless

    await asyncio.wait_for(done.wait(), 5)
    assert fired == ["first", "second", "third"]
    assert alarms.cancelled == 0  # the cancelled one was skipped when its time came


async def test_cancelled_alarms_are_swept_once_they_are_half_the_heap(monkeypatch) -> None:
    monkeypatch.setattr(supervision, "_SWEEP_AT", 10)
    loop = asyncio.get_running_loop()
    alarms = _alarms(loop)
    far = loop.time() + 3600
    for _ in range(30):
        alarms.call_at(far, lambda: None).cancel()
    kept = alarms.call_at(far + 1, lambda: None)

    # Swept whenever more than 10 were cancelled and they made half the heap: of 31 alarms,
    # at most 11 are left, the live one among them, and the count matches the heap.
    entries = [entry[2] for entry in alarms.heap]
    assert len(entries) <= 12 and kept in entries
    assert alarms.cancelled == sum(alarm.callback is None for alarm in entries)
    kept.cancel()


async def test_an_earlier_alarm_moves_the_loop_timer() -> None:
    loop = asyncio.get_running_loop()
    alarms = _alarms(loop)
    done = asyncio.Event()
    late = alarms.call_at(loop.time() + 3600, lambda: None)
    alarms.call_at(loop.time() + 0.01, done.set)

    await asyncio.wait_for(done.wait(), 5)  # not an hour
    late.cancel()
