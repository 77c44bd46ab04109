"""The default critic: the rules, a judge of progress.

Each sign of **progress** restarts the run's soft deadline (a quiet :class:`Extend` by the
soft timeout): a step starting or ending, a DELTA with content, a file chunk, a heartbeat
whose progress value rises above the highest seen, or a heartbeat whose message differs from
the previous one. A bare repeated heartbeat keeps the stream alive but is not progress — a
stuck tool that pings forever is still caught. The run's first event (the START of its
top-level step) is progress, so the count begins when the run does. Nothing else: the
half-time warning, the stop at the soft deadline, the hard cap and the caller's deadline are
the supervision's (:mod:`stargrpc.critic.supervision`), which applies them to every critic.
"""

from __future__ import annotations

import functools
import math

from stargrpc.critic.base import Extend, RunJudge, RunStart, VerdictSink
from stargrpc.v1 import events_pb2

_DELTA = events_pb2.STEP_PHASE_DELTA

#: The rules' name, as the ``critic`` label of the verdict metric.
RULES = "rules"


class RulesJudge(RunJudge):
    """Answers a quiet extension by the soft timeout to each event that shows progress.

    Attributes:
        progress: The verdict given on progress.
    """

    progress: Extend
    _best_progress_value: float
    _heartbeat_message: str

    def __init__(self, soft_timeout: float) -> None:
        self.progress = _progress(soft_timeout)
        self._best_progress_value = -math.inf
        self._heartbeat_message = ""

    def observe(self, event: events_pb2.RunEvent) -> Extend | None:
        """The quiet extension when ``event`` shows progress, else None."""
        kind = event.WhichOneof("kind")
        if kind == "step":
            # START/END of any step, and a DELTA only when it says something.
            step = event.step
            return self.progress if step.phase != _DELTA or step.delta else None
        if kind == "heartbeat":
            beat = event.heartbeat
            moved = False
            if beat.HasField("progress") and beat.progress > self._best_progress_value:
                self._best_progress_value = beat.progress
                moved = True
            if beat.message != self._heartbeat_message:
                self._heartbeat_message = beat.message
                moved = True
            return self.progress if moved else None
        return self.progress if kind == "file_chunk" else None


@functools.lru_cache(maxsize=64)
def _progress(soft_timeout: float) -> Extend:
    # One verdict per soft timeout, shared by the judges (it is immutable): all runs of a
    # tool have the same, and a frozen dataclass is slow to make for every run.
    return Extend(soft_timeout, quiet=True)


class RulesCritic:
    """The default critic (see the module docstring)."""

    name = RULES

    def judge(self, start: RunStart, verdicts: VerdictSink) -> RulesJudge:
        """A judge of progress for one run."""
        del verdicts  # the rules answer every event at once
        return RulesJudge(start.soft_timeout)
