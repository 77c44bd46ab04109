"""Micro-measurements behind the optimisation proposals in ``bench/README.md``:
``python -m bench.micro``. Each line is the cost of one per-event operation of the hot path
as it is written now, next to the cheaper way the proposal suggests. In-process, bounded
(a fixed number of repetitions), and never used by a test.
"""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable

from stargrpc.v1 import events_pb2, tool_service_pb2

REPEAT = 20_000


def _us(fn: Callable[[], object]) -> float:
    # The best of 5 rounds: the least-disturbed figure on a shared machine.
    return min(timeit.repeat(fn, number=REPEAT, repeat=5)) / REPEAT * 1e6


def _delta_event() -> events_pb2.RunEvent:
    event = events_pb2.RunEvent(run_id="0" * 32, seq=12345)
    event.time.GetCurrentTime()
    event.critic_time_left.FromMilliseconds(89_999)
    event.step.phase = events_pb2.STEP_PHASE_DELTA
    event.step.step.id = "s0"
    event.step.delta = "0000001\n"
    return event


def main() -> None:
    event = _delta_event()

    def stamp_wkt() -> None:
        event.time.GetCurrentTime()

    def stamp_ns() -> None:
        seconds, nanos = divmod(time.time_ns(), 1_000_000_000)
        event.time.seconds = seconds
        event.time.nanos = nanos

    def countdown_wkt() -> None:
        event.critic_time_left.FromMilliseconds(89_999)

    def countdown_fields() -> None:
        left = event.critic_time_left
        left.seconds, left.nanos = divmod(89_999, 1000)
        left.nanos *= 1_000_000

    def serialize() -> None:
        event.SerializeToString()

    def wrap_and_serialize() -> None:
        tool_service_pb2.ExecuteResponse(event=event).SerializeToString()

    deltas = [f"{i:07d}\n" for i in range(10)]

    def ten_messages() -> None:
        for text in deltas:
            one = events_pb2.RunEvent(run_id="0" * 32, seq=1)
            one.step.delta = text
            one.SerializeToString()

    def one_coalesced() -> None:
        one = events_pb2.RunEvent(run_id="0" * 32, seq=1)
        one.step.delta = "".join(deltas)
        one.SerializeToString()

    rows = [
        ("event.time.GetCurrentTime() (now, per event)", stamp_wkt),
        ("time.time_ns() into seconds/nanos (proposed)", stamp_ns),
        ("critic_time_left.FromMilliseconds() (now; no gain to have)", countdown_wkt),
        ("critic_time_left seconds/nanos set directly", countdown_fields),
        ("RunEvent.SerializeToString() (a delta event)", serialize),
        ("ExecuteResponse(event=…) + serialize (what each send costs)", wrap_and_serialize),
        ("10 delta events built and serialized", ten_messages),
        ("1 event carrying the same 10 deltas (coalesced)", one_coalesced),
    ]
    width = max(len(name) for name, _ in rows)
    for name, fn in rows:
        print(f"{name:<{width}}  {_us(fn):7.2f} µs")


if __name__ == "__main__":
    main()
