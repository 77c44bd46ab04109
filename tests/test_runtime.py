"""The runtime's own bookkeeping: drain, and runs leaving it however they end."""

from __future__ import annotations

import asyncio

import pytest

from stargrpc import ToolContext, metrics, tool
from stargrpc.errors import InvalidArgument
from stargrpc.principal import Principal
from stargrpc.registry import NoArguments, Registry, spec_of
from stargrpc.runs import run as run_module
from stargrpc.runs.concurrency import ConcurrencyLimits
from stargrpc.runs.event_sizes import EventSizes
from stargrpc.runs.outcome import Outcome
from stargrpc.runs.run import Run, RunLimits
from stargrpc.runs.runtime import RunRequest, Runtime
from stargrpc.settings import Settings
from stargrpc.stores.memory import MemoryRunLog, MemoryRunStore
from stargrpc.v1 import events_pb2

STARTED = asyncio.Event()
RELEASE = asyncio.Event()


@tool()
async def stubborn(ctx: ToolContext, args: NoArguments) -> str:
    """Swallows every cancellation until released."""
    STARTED.set()
    while not RELEASE.is_set():
        try:
            await RELEASE.wait()
        except asyncio.CancelledError:
            continue
    return "released"


async def test_drain_returns_once_a_stopped_run_has_ended_without_its_stubborn_tool() -> None:
    STARTED.clear()
    RELEASE.clear()
    runtime = Runtime(Registry([spec_of(stubborn)]))
    admitted = await runtime.admit(RunRequest(tool_name="stubborn", arguments={}),
                                   Principal("tester"))
    run = admitted.run
    assert run is not None
    task = run.start()
    try:
        await asyncio.wait_for(STARTED.wait(), 10)
        draining = asyncio.create_task(runtime.drain(30))
        await asyncio.sleep(0)
        assert run.stop(Outcome.CANCELLED, "CANCELLED", "enough")
        # The run ends without its tool after the stop grace; drain must not wait for the
        # tool (which never ends) until its own 30 s grace is over.
        async with asyncio.timeout(15):
            await draining
        assert run.result is not None
        assert run.result.outcome == events_pb2.OUTCOME_CANCELLED
        assert not task.done()  # the tool still holds the run's task
        assert runtime.runs == {}
    finally:
        RELEASE.set()  # let the stubborn task end, or the event loop cannot close
        await asyncio.wait_for(task, 10)


@tool()
async def quick(ctx: ToolContext, args: NoArguments) -> str:
    """Returns at once."""
    return "done"


async def _run_whose_ending_fails(monkeypatch: pytest.MonkeyPatch, where: str
                                  ) -> tuple[Runtime, Run, list[events_pb2.RunEvent]]:
    runtime = Runtime(Registry([spec_of(quick)]), concurrency=ConcurrencyLimits(total=1))
    in_flight = metrics.RUNS_IN_FLIGHT._value.get()
    if where == "result_message":
        def broken(*_: object) -> None:
            raise RuntimeError("the Result cannot be made")
        monkeypatch.setattr(run_module, "fit_result", broken)
    admitted = await runtime.admit(RunRequest(tool_name="quick", arguments={}),
                                   Principal("tester"))
    run = admitted.run
    assert run is not None
    if where == "observer":
        def observer(event: events_pb2.RunEvent) -> None:
            if event.HasField("result"):
                raise RuntimeError("an observer broke on the Result")
        run.observers.append(observer)  # before the run's task has had a turn
    await asyncio.wait_for(run.wait(), 10)
    assert metrics.RUNS_IN_FLIGHT._value.get() == in_flight
    events = [event async for event in run.log.follow()]
    return runtime, run, events


@pytest.mark.parametrize("where", ["observer", "result_message"])
async def test_a_run_whose_ending_fails_still_ends_and_leaves_the_runtime(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    runtime, run, events = await _run_whose_ending_fails(monkeypatch, where)

    assert runtime.runs == {}
    assert runtime.concurrency.in_flight == 0  # the permit is back
    assert run.result is not None
    assert run.result.error.code == "INTERNAL"
    assert events[-1].result == run.result  # the log still ends with a Result
    assert await asyncio.wait_for(runtime.drain(30), 10) is None


@pytest.mark.parametrize("arguments", [{"x": 1}, {"": None}, {"success": False}])
async def test_a_tool_without_arguments_still_refuses_any_argument(
        arguments: dict[str, object]) -> None:
    runtime = Runtime(Registry([spec_of(quick)]))
    with pytest.raises(InvalidArgument) as refused:
        await runtime.admit(RunRequest(tool_name="quick", arguments=arguments),
                            Principal("tester"))
    assert [v.field for v in refused.value.violations] == [f"arguments.{next(iter(arguments))}"]
    assert runtime.runs == {} and runtime.concurrency.in_flight == 0

    # Without arguments it runs, every time.
    for _ in range(2):
        admitted = await runtime.admit(RunRequest(tool_name="quick", arguments={}),
                                       Principal("tester"))
        assert admitted.run is not None
        assert admitted.run.args.model_dump() == {}
        assert (await asyncio.wait_for(admitted.run.wait(), 10)).output == "done"


async def test_a_finished_run_is_counted_with_its_results_outcome_and_duration() -> None:
    runtime = Runtime(Registry([spec_of(quick)]))

    def sample(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, {"tool": "quick", **labels}) or 0.0

    before = (sample("tool_executor_tasks_total", outcome="ok"),
              sample("tool_executor_duration_seconds_sum"),
              sample("tool_executor_duration_seconds_count"))
    admitted = await runtime.admit(RunRequest(tool_name="quick", arguments={}),
                                   Principal("tester"))
    assert admitted.run is not None
    result = await asyncio.wait_for(admitted.run.wait(), 10)
    await asyncio.sleep(0)  # the finish hooks ran with the Result

    assert sample("tool_executor_tasks_total", outcome="ok") == before[0] + 1
    assert sample("tool_executor_duration_seconds_count") == before[2] + 1
    assert sample("tool_executor_duration_seconds_sum") == pytest.approx(
        before[1] + result.duration.ToNanoseconds() / 1e9, abs=1e-12)
    assert admitted.run.duration_ns == result.duration.ToNanoseconds()


@tool()
async def deltas_then_large_output(ctx: ToolContext, args: NoArguments) -> str:
    """A few deltas (as many as ``DELTAS[0]``), a turn of the loop, then output too large
    for the Result (cut, with a notice before the Result)."""
    for index in range(DELTAS[0]):
        await ctx.delta(f"{index}\n")
    await asyncio.sleep(0)
    return "x" * (10 * 1024 * 1024)


DELTAS = [0]


@pytest.mark.parametrize("deltas", range(20))
async def test_a_run_ends_with_its_notices_and_result_in_one_batch(deltas: int) -> None:
    # A follower that is always waiting reads each batch the moment the run gives the loop
    # a turn: whatever the count of events before them, the notice of the cut and the
    # Result come in one batch (the audit reads the cuts from the Result's batch).
    DELTAS[0] = deltas
    runtime = Runtime(Registry([spec_of(deltas_then_large_output)]))
    admitted = await runtime.admit(
        RunRequest(tool_name="deltas_then_large_output", arguments={}), Principal("tester"))
    batches = [list(batch) async for batch in admitted.log.follow_batches(0)]
    last = batches[-1]
    assert last[-1].HasField("result")
    assert [e.notice.code for e in last if e.HasField("notice")] == ["OUTPUT_TRUNCATED"]


async def test_a_run_whose_ending_fails_after_its_result_keeps_that_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The Result is in the log when something after it fails (here the store's bookkeeping
    # of the finished run): the run's Result is that one, not a stand-in the log never got.
    def broken(*_: object) -> None:
        raise RuntimeError("the store's bookkeeping broke")

    monkeypatch.setattr(MemoryRunStore, "_record_finish", broken)
    runtime = Runtime(Registry([spec_of(quick)]))
    admitted = await runtime.admit(RunRequest(tool_name="quick", arguments={}),
                                   Principal("tester"))
    assert admitted.run is not None
    result = await asyncio.wait_for(admitted.run.wait(), 10)
    events = [event async for event in admitted.log.follow()]

    assert result.outcome == events_pb2.OUTCOME_OK and result.output == "done"
    assert events[-1].result == result
    assert [e for e in events if e.HasField("result")] == [events[-1]]
    assert runtime.runs == {}


#: The settings each run of :func:`reads_settings` found in its context.
SETTINGS_SEEN: list[Settings] = []


@tool()
async def reads_settings(ctx: ToolContext, args: NoArguments) -> str:
    """Notes the settings its context hands it."""
    SETTINGS_SEEN.append(ctx.settings)
    return "done"


async def test_every_run_keeps_to_the_limits_its_runtime_made_once_from_the_settings(
        ) -> None:
    settings = Settings(inline_file_bytes=1234, file_chunk_bytes=4096, steer_max_pending=3,
                        max_event_bytes=1024 * 1024)
    runtime = Runtime(Registry([spec_of(reads_settings)]), settings=settings)
    SETTINGS_SEEN.clear()
    runs = []
    for _ in range(2):
        admitted = await runtime.admit(RunRequest(tool_name="reads_settings", arguments={}),
                                       Principal("tester"))
        assert admitted.run is not None
        runs.append(admitted.run)
        await asyncio.wait_for(admitted.run.wait(), 10)

    limits = runtime.run_limits
    assert runs[0].limits is limits and runs[1].limits is limits  # made once, not per run
    assert (limits.inline_file_bytes, limits.file_chunk_bytes, limits.steer_max_pending) == \
        (1234, 4096, 3)
    assert limits.sizes == EventSizes.for_send_limit(1024 * 1024)
    # The tool reads the runtime's settings, which the run hands to its context only.
    assert len(SETTINGS_SEEN) == 2 and all(seen is settings for seen in SETTINGS_SEEN)
    assert not hasattr(runs[0], "settings")


async def test_a_run_made_without_a_runtime_shares_the_default_limits_and_settings() -> None:
    SETTINGS_SEEN.clear()
    runs = [Run(f"r{i}", spec_of(reads_settings), NoArguments(), Principal("tester"), {},
                MemoryRunLog(f"r{i}")) for i in range(2)]
    for run in runs:
        run.start()
        assert (await asyncio.wait_for(run.wait(), 10)).output == "done"

    assert runs[0].limits is RunLimits.default() and runs[1].limits is RunLimits.default()
    assert RunLimits.default() == RunLimits.from_settings(Settings())
    # One Settings for every such run, not one made per run.
    assert len(SETTINGS_SEEN) == 2 and SETTINGS_SEEN[0] is SETTINGS_SEEN[1]
    assert isinstance(SETTINGS_SEEN[0], Settings)
