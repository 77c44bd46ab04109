"""The default critic (the rules) and the supervision on real runs (no server): progress
detection, the time left stamped on every event, the half-time notice, the three limits and
the counters."""

from __future__ import annotations

import asyncio
import uuid

from pydantic import BaseModel

from stargrpc import ToolContext, metrics, tool
from stargrpc.critic.supervision import (
    CLIENT_DEADLINE,
    HARD_TIMEOUT,
    NO_PROGRESS,
    Supervision,
    SupervisionPolicy,
)
from stargrpc.principal import Principal
from stargrpc.registry import NoArguments, Registry, spec_of
from stargrpc.runs.run import Run
from stargrpc.runs.runtime import RunRequest, Runtime
from stargrpc.settings import Settings
from stargrpc.stores.memory import MemoryRunLog
from stargrpc.v1 import events_pb2
from tests.critic.tools import hangs, impatient
from tests.helpers import phases

WAIT = 30.0  # generous bound on any wait for a run to end; never a performance claim


@tool()
async def ticks(ctx: ToolContext) -> str:
    """Make progress every 50 ms, 20 times."""
    async with ctx.step("ticking") as step:
        for i in range(20):
            await asyncio.sleep(0.05)
            await step.delta(f"{i} ")
    return "done"


@tool()
async def lulls(ctx: ToolContext) -> str:
    """Progress, a lull of 0.6 s, progress again, then a hang."""
    await ctx.delta("before")
    await asyncio.sleep(0.6)
    await ctx.delta("after")
    await asyncio.Event().wait()
    return "unreachable"


def make_run(fn: object) -> Run:
    spec = spec_of(fn)
    assert spec is not None
    args: BaseModel = spec.args_model() if spec.takes_args else NoArguments()
    run_id = uuid.uuid4().hex
    return Run(run_id, spec, args, Principal("tester"), {}, MemoryRunLog(run_id))


async def supervised_events(fn: object, policy: SupervisionPolicy
                            ) -> tuple[Supervision, list[events_pb2.RunEvent]]:
    run = make_run(fn)
    supervision = Supervision(run, policy)
    supervision.start()
    run.start()
    await asyncio.wait_for(run.wait(), WAIT)
    return supervision, [event async for event in run.log.follow(0)]


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels or None) or 0.0


def heartbeat(message: str = "", progress: float | None = None) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.heartbeat.message = message
    if progress is not None:
        event.heartbeat.progress = progress
    return event


def step_event(phase: int, delta: str = "") -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.step.phase = phase  # type: ignore[assignment]
    event.step.delta = delta
    return event


async def test_only_real_progress_counts() -> None:
    supervision = Supervision(make_run(hangs), SupervisionPolicy(10, 100))

    def counts(event: events_pb2.RunEvent) -> bool:
        before = supervision.progress_events
        supervision.observe(event)
        return supervision.progress_events > before

    # Bare heartbeats, repeated, are not progress.
    assert not counts(heartbeat())
    assert not counts(heartbeat())
    # A heartbeat whose message changed is; the same message again is not.
    assert counts(heartbeat("fetching page 1"))
    assert not counts(heartbeat("fetching page 1"))
    assert counts(heartbeat("fetching page 2"))
    # A rising progress value is; the same or a lower one is not.
    assert counts(heartbeat("fetching page 2", 0.1))
    assert not counts(heartbeat("fetching page 2", 0.1))
    assert not counts(heartbeat("fetching page 2", 0.05))
    assert counts(heartbeat("fetching page 2", 0.2))
    # Steps starting and ending, and deltas with content, are; an empty delta and the
    # critic's own notices are not.
    assert counts(step_event(events_pb2.STEP_PHASE_START))
    assert counts(step_event(events_pb2.STEP_PHASE_DELTA, "x"))
    assert not counts(step_event(events_pb2.STEP_PHASE_DELTA, ""))
    assert counts(step_event(events_pb2.STEP_PHASE_END))
    notice = events_pb2.RunEvent()
    notice.notice.code = NO_PROGRESS
    assert not counts(notice)
    chunk = events_pb2.RunEvent()
    chunk.file_chunk.data = b"abc"
    assert counts(chunk)


async def test_every_event_carries_the_time_left() -> None:
    supervision = Supervision(make_run(hangs), SupervisionPolicy(10, 100))
    events = [heartbeat(), step_event(events_pb2.STEP_PHASE_DELTA, "x"), heartbeat()]
    for event in events:
        supervision.observe(event)

    lefts = [event.critic_time_left.ToNanoseconds() / 1e9 for event in events]
    assert all(event.HasField("critic_time_left") for event in events)
    assert all(0 < left <= 10 for left in lefts)
    # A bare heartbeat after the delta does not give time back.
    assert lefts[2] <= lefts[1]


async def test_hard_cap_and_deadline_bound_the_time_left() -> None:
    loop = asyncio.get_running_loop()
    capped = Supervision(make_run(hangs), SupervisionPolicy(10, 2))
    assert 0 < capped.time_left() <= 2
    deadline = Supervision(make_run(hangs), SupervisionPolicy(10, 100, loop.time() + 1))
    assert 0 < deadline.time_left() <= 1


async def test_hung_run_is_warned_at_half_time_then_stopped_with_its_output() -> None:
    warnings = sample("tool_executor_critic_warnings_total")
    kills = sample("tool_executor_critic_kills_total", reason="no_progress")

    supervision, events = await supervised_events(hangs, SupervisionPolicy(0.6, 30))

    assert phases(events) == ["START s0", "DELTA s0 'partial output'", "NOTICE",
                              "END s0 ERROR", "RESULT TIMEOUT"]
    notice = events[2].notice
    assert notice.code == NO_PROGRESS
    assert notice.level == events_pb2.NOTICE_LEVEL_WARNING
    assert notice.message.endswith("; stopping at 0.6 s")
    result = events[-1].result
    assert result.error.code == NO_PROGRESS
    assert result.error.message == "no progress for 0.6 s"
    assert result.output == "partial output"
    assert result.duration.ToNanoseconds() >= 0.6e9  # not stopped before its time
    # Once the run is stopping, nothing is left.
    assert events[-1].critic_time_left.ToNanoseconds() == 0
    assert supervision.warned
    assert sample("tool_executor_critic_warnings_total") == warnings + 1
    assert sample("tool_executor_critic_kills_total", reason="no_progress") == kills + 1


async def test_progress_extends_the_soft_deadline() -> None:
    extensions = sample("tool_executor_critic_extensions_total")

    _, events = await supervised_events(ticks, SupervisionPolicy(0.4, 30))

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert events[-1].result.output == "done"
    # 20 ticks of 50 ms: the run lasted well past its 0.4 s soft timeout.
    assert events[-1].result.duration.ToNanoseconds() > 0.4e9
    assert sample("tool_executor_critic_extensions_total") > extensions


async def test_progress_after_a_warning_starts_over() -> None:
    _, events = await supervised_events(lulls, SupervisionPolicy(0.8, 30))

    # Warned in the lull, rescued by the second delta, warned again, then stopped.
    assert phases(events) == ["START s0", "DELTA s0 'before'", "NOTICE", "DELTA s0 'after'",
                              "NOTICE", "END s0 ERROR", "RESULT TIMEOUT"]
    assert events[-1].result.output == "beforeafter"
    assert events[-1].result.duration.ToNanoseconds() >= 1.4e9  # 0.6 s lull + 0.8 s


async def test_hard_cap_stops_a_progressing_run() -> None:
    kills = sample("tool_executor_critic_kills_total", reason="hard_timeout")

    _, events = await supervised_events(ticks, SupervisionPolicy(30, 0.3))

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_TIMEOUT
    assert result.error.code == HARD_TIMEOUT
    assert result.error.message == "the run reached its 0.3 s cap"
    assert sample("tool_executor_critic_kills_total", reason="hard_timeout") == kills + 1


async def test_client_deadline_wins_over_the_critic() -> None:
    deadline = asyncio.get_running_loop().time() + 0.3

    _, events = await supervised_events(ticks, SupervisionPolicy(30, 60, deadline))

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_TIMEOUT
    assert result.error.code == CLIENT_DEADLINE


async def test_tool_soft_timeout_overrides_the_default() -> None:
    supervision, events = await supervised_events(impatient, SupervisionPolicy(60, 600))

    assert supervision.soft_timeout == 0.4
    assert events[-1].result.error.message == "no progress for 0.4 s"


async def test_a_run_submitted_without_a_policy_is_supervised_by_the_servers() -> None:
    runtime = Runtime(Registry([spec_of(hangs)]), settings=Settings(critic_soft_timeout=0.4))
    admitted = await runtime.admit(RunRequest(tool_name="hangs", arguments={}),
                                     Principal("tester"))
    assert admitted.run is not None
    result = await asyncio.wait_for(admitted.run.wait(), WAIT)

    assert result.error.code == NO_PROGRESS
    assert result.error.message == "no progress for 0.4 s"


async def test_huge_timeouts_still_stamp_a_valid_time_left() -> None:
    supervision = Supervision(make_run(hangs), SupervisionPolicy(1e300, 1e300))
    event = heartbeat("working")

    supervision.observe(event)

    assert event.critic_time_left.seconds >= 365 * 24 * 3600
    assert event.SerializeToString()  # a valid Duration
