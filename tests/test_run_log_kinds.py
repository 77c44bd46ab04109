"""A run over a log of another kind than this package's (only the RunLog protocol) still
records everything, steering included, in order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from stargrpc import ToolContext, tool
from stargrpc.principal import Principal
from stargrpc.registry import NoArguments, spec_of
from stargrpc.runs.run import STEERED, Run
from stargrpc.stores.memory import MemoryRunLog
from stargrpc.v1 import events_pb2


class ProtocolOnlyLog:
    """The RunLog protocol and nothing more, over an embedded log."""

    def __init__(self, run_id: str) -> None:
        self._inner = MemoryRunLog(run_id)
        self.run_id, self.owner, self.tool = run_id, "", ""

    @property
    def finished(self) -> bool:
        return self._inner.finished

    @property
    def last_seq(self) -> int:
        return self._inner.last_seq

    async def append(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        return await self._inner.append(event)

    def append_nowait(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        return self._inner.append_nowait(event)

    def follow(self, after_seq: int = 0, *, max_lag: int = 0
               ) -> AsyncIterator[events_pb2.RunEvent]:
        return self._inner.follow(after_seq, max_lag=max_lag)

    def follow_batches(self, after_seq: int = 0, *, max_lag: int = 0
                       ) -> AsyncGenerator[Sequence[events_pb2.RunEvent], None]:
        return self._inner.follow_batches(after_seq, max_lag=max_lag)

    def encoded(self, seq: int) -> bytes:
        return self._inner.encoded(seq)


@tool()
async def listens(ctx: ToolContext, args: NoArguments) -> str:
    """Waits for one steering message and says it back."""
    return f"heard {await ctx.steering().__anext__()}"


async def test_a_steered_run_over_a_protocol_only_log_records_the_steer_before_the_end(
        ) -> None:
    log = ProtocolOnlyLog("r1")
    spec = spec_of(listens)
    run = Run("r1", spec, NoArguments(), Principal("tester"), {}, log)
    run.start()
    started = log.follow(0)
    await asyncio.wait_for(anext(started), 10)  # the START is in: the tool is waiting
    await started.aclose()  # type: ignore[attr-defined]
    run.steer("left", source="principal tester")
    result = await asyncio.wait_for(run.wait(), 10)

    events = [e async for e in log.follow(0)]
    notices = [e.notice for e in events if e.HasField("notice")]
    assert result.output == "heard left"
    assert [(n.code, n.message, n.source) for n in notices] == \
        [(STEERED, "left", "principal tester")]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
