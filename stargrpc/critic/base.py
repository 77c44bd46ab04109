"""The critic's interface: the judge of a run, told of its start and of each of its events.

A :class:`Critic` opens one :class:`RunJudge` per supervised run (:meth:`Critic.judge`),
given a :class:`RunStart` view of the run and a :data:`VerdictSink`. The judge sees every
event of the run (:meth:`RunJudge.observe`, on the run's hot path: keep it cheap) and
answers with verdicts, either by returning one from ``observe`` or, for a judge that thinks
asynchronously (a remote critic), by calling the sink later:

- :class:`Extend` — move the soft deadline to ``seconds`` from now;
- :class:`Warn` — a warning notice for the run's watchers;
- :class:`Steer` — a message for the running tool (``ctx.steering()``);
- :class:`Stop` — stop the run now, with a reason code;
- :class:`Keep` — no change (an answer to :meth:`RunJudge.ask` that lets the run stop).

The supervision (:mod:`stargrpc.critic.supervision`) applies the verdicts. Whatever a
critic answers, the hard cap and the caller's deadline still stop the run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from stargrpc.v1 import events_pb2

#: What a stop code must look like (the codes of ErrorReason, or a critic's own).
STOP_CODE = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)*")
#: Longest message a Warn or Steer verdict may carry, in bytes of UTF-8.
MAX_VERDICT_MESSAGE_BYTES = 4096


@dataclass(frozen=True)
class RunStart:
    """What a critic is told when a run starts.

    Attributes:
        run_id: The run's id.
        tool: The tool's name.
        arguments: The validated arguments, as JSON-ready data (a view: do not change it).
        principal: The id of who started the run.
        soft_timeout: Seconds the run may go without an extension (progress, for the rules).
        hard_timeout: Seconds the run may take at most.
        deadline: Seconds left before the caller's deadline, or None without one.
    """

    run_id: str
    tool: str
    arguments: Mapping[str, Any]
    principal: str
    soft_timeout: float
    hard_timeout: float
    deadline: float | None = None


@dataclass(frozen=True)
class Extend:
    """Moves the soft deadline to ``seconds`` from now.

    Attributes:
        seconds: How long the run may now go without another extension (> 0).
        reason: Why, shown in the CRITIC_EXTENDED notice.
        quiet: Restart the deadline without a notice: what the rules do on each sign of
            progress, far too often to announce.
    """

    seconds: float
    reason: str = ""
    quiet: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class Warn:
    """A warning notice (CRITIC_WARNING) for the run's watchers."""

    message: str


@dataclass(frozen=True)
class Steer:
    """A message for the running tool, through ``Run.steer``."""

    message: str


@dataclass(frozen=True)
class Stop:
    """Stops the run: Result{CANCELLED} with ``code`` (CRITIC_STOPPED by default)."""

    code: str
    reason: str


@dataclass(frozen=True)
class Keep:
    """No change: the critic lets the run go on as it is (an answer to
    :meth:`RunJudge.ask` that is not an extension, so the run is stopped)."""


Verdict = Extend | Warn | Steer | Stop | Keep

class CriticError(Exception):
    """A critic broke the contract (a verdict that makes no sense, a lost connection):
    the supervision falls back to the rules for the run."""


#: Where an asynchronous judge delivers a verdict it reached later, or the CriticError
#: that ends its judging (the rules then take over the run).
VerdictSink = Callable[[Verdict | CriticError], None]


def check_verdict(verdict: object) -> Verdict:
    """``verdict`` if it makes sense.

    Raises:
        CriticError: It is not a verdict, or one with an impossible value.
    """
    # Each field's type too: a critic is anybody's Python, and a message that is None or a
    # time that is a string must drop the critic, not fail the run it judges.
    if isinstance(verdict, Extend):
        if not _is_seconds(verdict.seconds):
            raise CriticError(f"an extension must be a positive time, not {verdict.seconds!r}")
        if not isinstance(verdict.reason, str):
            raise CriticError(f"an extension's reason must be text, not "
                              f"{type(verdict.reason).__name__}")
    elif isinstance(verdict, Warn | Steer):
        if not isinstance(verdict.message, str):
            raise CriticError(f"a {type(verdict).__name__.lower()} verdict's message must be "
                              f"text, not {type(verdict.message).__name__}")
        if not verdict.message.strip():
            raise CriticError(f"a {type(verdict).__name__.lower()} verdict needs a message")
        if len(verdict.message.encode()) > MAX_VERDICT_MESSAGE_BYTES:
            raise CriticError(f"a verdict's message is over {MAX_VERDICT_MESSAGE_BYTES} bytes")
    elif isinstance(verdict, Keep):
        pass
    elif isinstance(verdict, Stop):
        if not isinstance(verdict.code, str) or not isinstance(verdict.reason, str):
            raise CriticError("a stop verdict's code and reason must be text")
        if len(verdict.code) > 64 or not STOP_CODE.fullmatch(verdict.code):
            raise CriticError(f"a stop code must look like LOOP_DETECTED, not "
                              f"{verdict.code[:64]!r}")
    else:
        raise CriticError(f"not a verdict: {type(verdict).__name__}")
    return verdict


def _is_seconds(value: object) -> bool:
    """Whether ``value`` is a time an extension may give: a finite number above 0."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and 0 < value < float("inf"))


class RunJudge:
    """A critic's judge of one run. Subclass it and override what you need: by default a
    judge answers nothing, so the run is stopped at its first soft deadline."""

    def observe(self, event: events_pb2.RunEvent) -> Verdict | None:
        """Sees one event of the run just before it is logged; may answer a verdict.

        Called on the run's hot path (every delta): no I/O, nothing slow. Do not change
        the event.
        """
        del event
        return None

    def ask(self, idle: float) -> bool:
        """The run's soft deadline is reached, ``idle`` seconds after the last extension.

        Returns:
            True when a verdict will come through the sink: the supervision then waits up
            to the verdict budget before it stops the run (and falls back to the rules when
            nothing came). False stops the run now for lack of progress.
        """
        del idle
        return False

    def close(self) -> None:
        """The run has ended (or its supervision fell back to the rules): let go."""


@runtime_checkable
class Critic(Protocol):
    """A judge of runs: opens a :class:`RunJudge` for each supervised run.

    Attributes:
        name: Short name, the ``critic`` label of the verdict metric.
    """

    name: str

    def judge(self, start: RunStart, verdicts: VerdictSink) -> RunJudge:
        """A judge for the run ``start`` describes; later verdicts go to ``verdicts``."""
