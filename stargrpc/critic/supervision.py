"""Supervision: the stage of the run pipeline that puts each run under its critic.

Every run has three limits, and the first one reached stops it:

- a **soft deadline** that the run's critic moves out with :class:`~stargrpc.critic.base.Extend`
  verdicts — the rules (:mod:`stargrpc.critic.rules`) extend it by the soft timeout
  (``critic_soft_timeout``, or the tool's own ``soft_timeout``) on each sign of progress. At
  half the time since the last extension the run gets a warning notice; at the deadline it is
  stopped with ``Result{TIMEOUT}`` and code ``CRITIC_NO_PROGRESS``. A judge that thinks
  asynchronously (the remote critic) is first *asked*, and gets the verdict budget to answer;
- a **hard cap** (``critic_hard_timeout``) on the total run time, progress or not
  (code ``CRITIC_HARD_TIMEOUT``);
- the **caller's deadline**, which always wins: the run is stopped just before it passes
  (code ``CLIENT_DEADLINE``), so a run never outlives the call that started it.

No critic can move the last two. A critic's other verdicts are applied here too: a warning
(``CRITIC_WARNING``), a steer (``CRITIC_STEERED``, then :meth:`stargrpc.runs.run.Run.steer`), a stop
(``CRITIC_STOPPED``, then ``Result{CANCELLED}`` with the critic's code). A critic that breaks
the contract — raises, answers garbage, disconnects, misses its budget — is dropped for the
run and the rules, which watched every event alongside it, take over (``CRITIC_FALLBACK``).
Every verdict but the rules' quiet extensions is a notice, a count of
``tool_executor_critic_verdicts_total{verdict,critic}`` and a fact in the call's audit record
— up to :data:`MAX_VERDICT_NOTICES` notices of warnings, extensions and steers per run: a
critic that keeps sending them (a remote one can send thousands a second) would otherwise
fill the run's log, which every follower reads and the run store keeps. Past that, one
more notice, ``CRITIC_NOTICES_LIMITED`` from the server, says so; the verdicts are still
applied and counted, and the audit record tells how many notices were left out.

Stopping goes through :meth:`stargrpc.runs.run.Run.stop`, which cancels the tool and still ends the
run with the top-level END (error) and a Result carrying the output produced so far. Every
event of a supervised run carries ``critic_time_left``: the time before the run would be
stopped if nothing else happened.

**Cost.** One ``run.observers`` callback per event (the judge's look at it, a few comparisons,
one Duration stamp) plus a single alarm per run, on one loop timer that every run of the
event loop shares (:class:`_Alarms`). An extension only records
the new deadline; the timer is not rescheduled per event. When it fires it looks at the
latest deadline and either acts (warn, ask, stop) or re-arms itself for the next point that
matters, so a run that streams thousands of deltas a second costs no timer churn.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import math
import time
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from stargrpc import metrics
from stargrpc.critic.base import (
    Critic,
    CriticError,
    Extend,
    Keep,
    RunJudge,
    RunStart,
    Steer,
    Stop,
    Verdict,
    Warn,
    check_verdict,
)
from stargrpc.critic.rules import RULES, RulesCritic, RulesJudge
from stargrpc.errors import RequestError
from stargrpc.registry import ToolSpec
from stargrpc.runs.call_record import CallRecord, current_call
from stargrpc.runs.outcome import Outcome
from stargrpc.runs.run import Run
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2

log = structlog.get_logger("stargrpc.critic")

#: Codes of the critic's notices and of the Results of the runs it stops.
NO_PROGRESS = "CRITIC_NO_PROGRESS"
HARD_TIMEOUT = "CRITIC_HARD_TIMEOUT"
CLIENT_DEADLINE = "CLIENT_DEADLINE"
EXTENDED = "CRITIC_EXTENDED"
WARNING = "CRITIC_WARNING"
NOTICES_LIMITED = "CRITIC_NOTICES_LIMITED"
STEERED = "CRITIC_STEERED"
STOPPED = "CRITIC_STOPPED"
FALLBACK = "CRITIC_FALLBACK"

#: Notices of a critic's warnings, extensions and steers that one run's log takes; later
#: ones are left out (the verdicts still apply). Stops and fallbacks end the critic's say,
#: so they are never left out.
MAX_VERDICT_NOTICES = 100

#: How long before the caller's deadline the run is stopped, so that the stopped run's
#: Result can still reach the caller instead of a bare DEADLINE_EXCEEDED.
CLIENT_DEADLINE_MARGIN = 0.05

# The longest time left stamped on an event (a Duration holds at most ~10,000 years; absurd
# configured timeouts must not make stamping fail).
_MAX_TIME_LEFT = 10 * 365 * 24 * 3600.0

_KILLS_BY_REASON = {
    NO_PROGRESS: metrics.CRITIC_KILLS.labels("no_progress"),
    HARD_TIMEOUT: metrics.CRITIC_KILLS.labels("hard_timeout"),
    CLIENT_DEADLINE: metrics.CRITIC_KILLS.labels("client_deadline"),
}
# _CRITICS_RAISE: a critic is anybody's Python (a tool's own, or the server's); whatever it
# raises (SystemExit or KeyboardInterrupt too, which out of a callback of the event loop
# would stop the loop and the server with it) drops it for the rules.

#: What a quiet extension's seconds may be to be applied on the hot path without a check.
_TIME_TYPES = (float, int)
_FOREVER = math.inf

_VERDICT_NAMES = {Extend: "extend", Warn: "warn", Steer: "steer", Stop: "stop", Keep: "keep"}


@dataclass(frozen=True)
class SupervisionPolicy:
    """How one call's run is supervised.

    Attributes:
        soft_timeout: Seconds without progress before the run is stopped (a tool's own
            ``soft_timeout`` takes precedence).
        hard_timeout: Seconds the run may take at most, progress or not.
        deadline: The caller's deadline as an event-loop time (``loop.time()``), or None
            when the call has no deadline.
    """

    soft_timeout: float
    hard_timeout: float
    deadline: float | None = None

    @classmethod
    def for_call(cls, settings: Settings, time_remaining: float | None = None
                 ) -> SupervisionPolicy:
        """The server's policy for a call with ``time_remaining`` seconds before its
        deadline (None: no deadline). Needs a running event loop."""
        if time_remaining is None and cls is SupervisionPolicy:
            return _without_deadline(settings.critic_soft_timeout, settings.critic_hard_timeout)
        deadline = None
        if time_remaining is not None:
            deadline = asyncio.get_running_loop().time() + time_remaining
        return cls(settings.critic_soft_timeout, settings.critic_hard_timeout, deadline)

    def soft_timeout_for(self, spec: ToolSpec) -> float:
        """The soft timeout that applies to a run of ``spec``."""
        return spec.soft_timeout if spec.soft_timeout else self.soft_timeout


@functools.lru_cache(maxsize=16)
def _without_deadline(soft_timeout: float, hard_timeout: float) -> SupervisionPolicy:
    # A call without a deadline gets the server's policy, the same for every such call: one
    # instance (it is immutable) rather than a frozen dataclass made for each.
    return SupervisionPolicy(soft_timeout, hard_timeout)


@dataclass(frozen=True)
class SupervisedRequest:
    """A gRPC request handed to the service with the supervision policy of its call (by
    :class:`stargrpc.server.interceptors.critic.CriticInterceptor`)."""

    request: Any
    policy: SupervisionPolicy


class _Alarm:
    """A callback due at a time on :class:`_Alarms`; :meth:`cancel` as for a TimerHandle."""

    __slots__ = ("_alarms", "callback")

    def __init__(self, callback: Callable[[], None], alarms: _Alarms) -> None:
        self.callback: Callable[[], None] | None = callback
        self._alarms = alarms

    def cancel(self) -> None:
        """The callback will not be called."""
        if self.callback is not None:
            self.callback = None
            self._alarms.cancelled += 1


class _Alarms:
    """The supervision timers of one event loop, on one loop timer set for the earliest.

    A run's alarm is armed when it starts and cancelled when it ends, which for most runs
    comes long before it is due: a ``loop.call_at`` per run would leave each cancelled
    TimerHandle in the loop's heap (ordered by a comparison written in Python) until it is
    due or swept. Here an alarm is a (time, count, alarm) tuple, ordered in C, in a heap of
    its own; a cancelled one is skipped when its time comes, or swept with the others once
    they are half the heap. The loop timer is moved only for an alarm earlier than every
    other (all runs share the same timeouts, so a new run's alarm comes last).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: the alarms are kept per loop in a WeakKeyDictionary, by the loop.
        self.loop = weakref.ref(loop)
        self.heap: list[tuple[float, int, _Alarm]] = []
        self.cancelled = 0
        self._order = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = math.inf

    def call_at(self, when: float, callback: Callable[[], None]) -> _Alarm:
        """Calls ``callback`` at loop time ``when`` (or just before, as the loop's timers)."""
        alarm = _Alarm(callback, self)
        heapq.heappush(self.heap, (when, next(self._order), alarm))
        if when < self._armed_at:
            self._arm(when)
        elif self.cancelled > _SWEEP_AT and self.cancelled * 2 > len(self.heap):
            self.heap = [entry for entry in self.heap if entry[2].callback is not None]
            heapq.heapify(self.heap)
            self.cancelled = 0
        return alarm

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        loop = self.loop()
        assert loop is not None  # alarms are set from a callback of the loop
        self._handle = loop.call_at(when, self._fire)
        self._armed_at = when

    def _fire(self) -> None:
        self._handle = None
        self._armed_at = math.inf
        heap = self.heap
        # The loop runs a timer up to its clock's resolution early: so do the alarms.
        loop = self.loop()
        assert loop is not None  # this runs in it
        limit = loop.time() + _CLOCK_RESOLUTION
        due = []
        while heap and heap[0][0] <= limit:
            alarm = heapq.heappop(heap)[2]
            if alarm.callback is None:
                self.cancelled -= 1
            else:
                due.append(alarm)
        if heap:
            self._arm(heap[0][0])
        for alarm in due:
            callback, alarm.callback = alarm.callback, None
            if callback is None:  # cancelled by an earlier callback of this round
                self.cancelled -= 1
                continue
            try:
                callback()
            except Exception:
                log.exception("supervision_timer_failed")


#: Cancelled alarms left in the heap before they are swept (when half of it).
_SWEEP_AT = 1024
_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution

#: The alarms of each event loop (the last one looked up kept at hand).
_LOOP_ALARMS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Alarms] = \
    weakref.WeakKeyDictionary()
_last_alarms: _Alarms | None = None


def _alarms(loop: asyncio.AbstractEventLoop) -> _Alarms:
    global _last_alarms
    last = _last_alarms
    if last is not None and last.loop() is loop:
        return last
    alarms = _LOOP_ALARMS.get(loop)
    if alarms is None:
        alarms = _LOOP_ALARMS[loop] = _Alarms(loop)
    _last_alarms = alarms
    return alarms


def _seconds(value: float) -> str:
    return f"{round(value, 2):g} s"


class Supervision:
    """Supervises one run under one critic; see the module docstring.

    Attributes:
        run: The supervised run.
        critic: The name of the critic judging the run (``rules`` after a fallback).
        soft_timeout: Seconds without progress the rules allow.
        hard_timeout: Seconds in total allowed.
        progress_events: How many extensions (for the rules: events showing progress).
        warned: Whether the no-progress warning went out since the last extension.
        fallback: Why the critic was dropped for the rules ("" while it judges).
        verdicts: How many verdicts of each kind were applied (quiet extensions aside).
        notices_left_out: Notices of verdicts left out of the run's log, past
            :data:`MAX_VERDICT_NOTICES`.
    """

    run: Run
    critic: str
    soft_timeout: float
    hard_timeout: float
    progress_events: int
    warned: bool
    fallback: str
    notices_left_out: int
    _verdict_notices: int
    _verdicts: Counter[str] | None
    _judge: RunJudge
    _rules: RulesJudge | None
    _verdict_timeout: float
    _record: CallRecord | None
    _loop: asyncio.AbstractEventLoop
    _waiting: bool
    _hard_at: float
    _deadline_at: float
    _soft_span: float
    _soft_at: float
    _last_extend: float
    _seen_extend: float
    _rules_progress: float
    _asking_until: float
    _timer: _Alarm | None
    _tasks: set[asyncio.Task[None]] | None

    def __init__(self, run: Run, policy: SupervisionPolicy, critic: Critic | None = None, *,
                 verdict_timeout: float = 2.0) -> None:
        self.run = run
        self.soft_timeout = policy.soft_timeout_for(run.spec)
        self.hard_timeout = policy.hard_timeout
        self.progress_events = 0
        self.warned = False
        self.fallback = ""
        self.notices_left_out = 0
        self._verdict_notices = 0
        # Made when first needed: most runs get no verdict to count and spawn nothing.
        self._verdicts = None
        self._verdict_timeout = verdict_timeout
        self._record = current_call.get()
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self._deadline_at = (math.inf if policy.deadline is None
                             else policy.deadline - CLIENT_DEADLINE_MARGIN)
        self._soft_span = self.soft_timeout
        # A run that waits at its gates first (its lane's queue, an approval) is timed from
        # its START: only the caller's deadline runs while it waits.
        self._waiting = bool(run.gates)
        if self._waiting:
            self._hard_at = self._soft_at = math.inf
        else:
            self._hard_at = now + self.hard_timeout
            self._soft_at = now + self.soft_timeout
        self._last_extend = self._seen_extend = self._rules_progress = now
        self._asking_until = math.inf
        self._timer = None
        self._tasks = None
        rules = RulesJudge(self.soft_timeout)
        if critic is None or isinstance(critic, RulesCritic):
            self.critic, self._judge, self._rules = RULES, rules, None
        else:
            self.critic, self._rules = critic.name, rules
            self._judge = rules  # until the critic's own judge is open (start)
            self._open(critic, policy, now)

    def _open(self, critic: Critic, policy: SupervisionPolicy, now: float) -> None:
        run = self.run
        start = RunStart(
            run_id=run.run_id, tool=run.spec.name,
            arguments=run.args.model_dump(mode="json"), principal=run.principal.id,
            soft_timeout=self.soft_timeout, hard_timeout=self.hard_timeout,
            deadline=None if policy.deadline is None else max(0.0, policy.deadline - now))
        try:
            self._judge = critic.judge(start, self.deliver)
        except BaseException as exc:  # a critic's code: even SystemExit (see _CRITICS_RAISE)
            log.exception("critic_failed_to_open", critic=critic.name, run_id=run.run_id)
            self._fall_back(f"could not judge the run ({type(exc).__name__})", announce=False)

    @property
    def verdicts(self) -> Counter[str]:
        """How many verdicts of each kind were applied (quiet extensions aside)."""
        if self._verdicts is None:
            self._verdicts = Counter()
        return self._verdicts

    def start(self) -> None:
        """Hooks into the run (observer, finish hook) and arms the timer."""
        self.run.observers.append(self.observe)
        self.run.finish_hooks.append(self._on_finish)
        if self.fallback:  # the critic could not even open: say so once the run logs
            self._spawn(self.run.emit_notice(FALLBACK, self._fallback_message()))
        self._arm()

    # -- the hot path: one call per event -------------------------------------------------

    def observe(self, event: events_pb2.RunEvent) -> None:
        """Shows ``event`` to the critic, applies its verdict and stamps
        ``critic_time_left`` on the event."""
        # Called once per event: written for speed (the rules' quiet extension applied
        # inline, the Duration fields set directly).
        if self.run.stop_requested:
            # The run is ending (the steps closing now are not progress): nothing is left.
            event.critic_time_left.SetInParent()
            return
        now = self._loop.time()
        if self._waiting:
            if not event.HasField("step"):  # a notice while it waits: no progress to judge
                self._stamp_time_left(event, now)
                return
            self._begin(now)  # its first step event is its START
        try:
            verdict = self._judge.observe(event)
        except BaseException as exc:  # a critic's code (see _CRITICS_RAISE)
            log.exception("critic_observe_failed", critic=self.critic, run_id=self.run.run_id)
            verdict = None
            self._fall_back(f"failed ({type(exc).__name__})")
        if verdict is not None:
            if (verdict.__class__ is Extend and verdict.quiet
                    and verdict.seconds.__class__ in _TIME_TYPES
                    and 0 < verdict.seconds <= _FOREVER):
                # (any other extension goes through deliver, which checks it)
                self._soft_at = now + verdict.seconds
                self._soft_span = verdict.seconds
                self._last_extend = now
                self.progress_events += 1
            else:
                self.deliver(verdict)
        rules = self._rules
        if rules is not None and rules.observe(event) is not None:
            self._rules_progress = now
        left = min(self._soft_at, self._hard_at, self._deadline_at) - now
        # Whole milliseconds: plenty for a countdown, and shorter on the wire.
        millis = 0 if left <= 0 else int(min(left, _MAX_TIME_LEFT) * 1000 + 0.5)
        stamp = event.critic_time_left
        stamp.seconds, rest = divmod(millis, 1000)
        stamp.nanos = rest * 1_000_000

    def _stamp_time_left(self, event: events_pb2.RunEvent, now: float) -> None:
        """Stamps ``critic_time_left`` on an event of a run still waiting to start: the
        time left before the caller's deadline, or nothing when it has none."""
        left = self._deadline_at - now
        if left == math.inf:
            return
        millis = 0 if left <= 0 else int(min(left, _MAX_TIME_LEFT) * 1000 + 0.5)
        stamp = event.critic_time_left
        stamp.seconds, rest = divmod(millis, 1000)
        stamp.nanos = rest * 1_000_000

    def _begin(self, now: float) -> None:
        """The run starts after waiting at its gates: its soft and hard timeouts start
        now."""
        self._waiting = False
        self._hard_at = now + self.hard_timeout
        self._soft_at = now + self._soft_span
        self._last_extend = self._seen_extend = self._rules_progress = now
        self._rearm()

    def time_left(self, now: float | None = None) -> float:
        """Seconds before the run is stopped if no extension comes."""
        now = self._loop.time() if now is None else now
        return max(0.0, min(self._soft_at, self._hard_at, self._deadline_at) - now)

    # -- verdicts -------------------------------------------------------------------------

    def deliver(self, verdict: Verdict | CriticError) -> None:
        """Applies one verdict of the run's critic (the sink given to its judge); a
        CriticError drops the critic for the rules."""
        if self.run.finished or self.run.stop_requested or self.fallback:
            return
        if isinstance(verdict, CriticError):
            self._fall_back(str(verdict))
            return
        try:
            verdict = check_verdict(verdict)
        except CriticError as exc:
            log.warning("critic_verdict_refused", critic=self.critic, run_id=self.run.run_id,
                        error=str(exc))
            self._fall_back(f"answered garbage ({exc})")
            return
        now = self._loop.time()
        name = _VERDICT_NAMES[type(verdict)]
        if not (isinstance(verdict, Extend) and verdict.quiet):
            self._count(name)
        answered = self._asking_until != math.inf
        self._asking_until = math.inf
        if isinstance(verdict, Extend):
            self._soft_at = now + verdict.seconds
            self._soft_span = verdict.seconds
            self._last_extend = now
            self.progress_events += 1
            if not verdict.quiet and self._may_notice():
                self._notice(EXTENDED, self._extended_message(verdict, now), warning=False)
        elif isinstance(verdict, Warn):
            if self._may_notice():
                self._notice(WARNING, verdict.message)
        elif isinstance(verdict, Steer):
            if self._may_notice():
                self._notice(STEERED, f"the {self.critic} critic steered the run",
                             warning=False)
            try:
                self.run.steer(verdict.message, source=f"critic {self.critic}")
            except RequestError as refused:  # the run is ending, or its queue is full
                log.info("critic_steer_refused", run_id=self.run.run_id, reason=str(refused))
        elif isinstance(verdict, Stop):
            code = verdict.code or STOPPED
            reason = verdict.reason.strip()[:500] or f"stopped by the {self.critic} critic"
            log.warning("critic_stopped_run", run_id=self.run.run_id, tool=self.run.spec.name,
                        critic=self.critic, code=code, reason=reason)
            self._spawn(self._notice_then_stop(code, reason))
            return
        if answered and not isinstance(verdict, Extend):
            # Asked at the soft deadline, the critic did not give more time.
            self._stop(NO_PROGRESS, f"no progress for {_seconds(self._soft_span)}")
        elif answered or isinstance(verdict, Extend):
            self._rearm()

    def _may_notice(self) -> bool:
        """Whether a verdict's notice goes into the run's log (see
        :data:`MAX_VERDICT_NOTICES`); the first one left out is replaced by a notice saying
        that further ones are."""
        if self._verdict_notices < MAX_VERDICT_NOTICES:
            self._verdict_notices += 1
            return True
        if not self.notices_left_out:
            log.warning("critic_notices_limited", critic=self.critic, run_id=self.run.run_id,
                        tool=self.run.spec.name, notices=MAX_VERDICT_NOTICES)
            self._notice(NOTICES_LIMITED, (
                f"the {self.critic} critic sent {MAX_VERDICT_NOTICES} notices; its further "
                "warnings, extensions and steers still apply but are left out of the run's "
                "log (the call's audit record counts them)"), warning=False)
        self.notices_left_out += 1
        self._record_facts()
        return False

    def _extended_message(self, verdict: Extend, now: float) -> str:
        message = f"the {self.critic} critic gave the run {_seconds(verdict.seconds)} more"
        if verdict.reason:
            message += f": {verdict.reason.strip()[:500]}"
        cap = min(self._hard_at, self._deadline_at)
        if now + verdict.seconds > cap:
            message += f" (the run still ends within {_seconds(cap - now)})"
        return message

    async def _notice_then_stop(self, code: str, reason: str) -> None:
        await self.run.emit_notice(STOPPED, f"the {self.critic} critic stopped the run: {reason}")
        self.run.stop(Outcome.CANCELLED, code, reason)

    def _fall_back(self, reason: str, *, announce: bool = True) -> None:
        """Drops the critic for the rules, which watched every event alongside it."""
        if self.fallback or self._rules is None:
            return
        self.fallback = reason
        self._count("fallback")
        judge, self._judge, self._rules = self._judge, self._rules, None
        if judge is not self._judge:
            try:
                judge.close()
            except BaseException:  # a critic's code (see _CRITICS_RAISE)
                log.exception("critic_close_failed", critic=self.critic)
        log.warning("critic_fallback", critic=self.critic, run_id=self.run.run_id,
                    tool=self.run.spec.name, reason=reason)
        self._soft_span = self.soft_timeout
        self._last_extend = self._rules_progress
        self._soft_at = self._rules_progress + self.soft_timeout
        self._asking_until = math.inf
        self.warned = False
        if announce:
            self._notice(FALLBACK, self._fallback_message())
            self._rearm()

    def _fallback_message(self) -> str:
        return (f"the {self.critic} critic {self.fallback}; the rules supervise the run "
                "from here")

    def _count(self, verdict: str) -> None:
        self.verdicts[verdict] += 1
        metrics.CRITIC_VERDICTS.labels(verdict, self.critic).inc()
        self._record_facts()

    def _record_facts(self) -> None:
        if self._record is not None:  # the call's audit record shows the critic's verdicts
            facts = ", ".join(f"{name} {count}" for name, count in self.verdicts.items())
            if self.notices_left_out:
                facts += (f"; {self.notices_left_out} notices left out of the run's log "
                          f"(after {MAX_VERDICT_NOTICES})")
            if self.fallback:
                facts += f"; fell back to the rules: {self.fallback}"
            self._record.extra["critic"] = f"critic {self.critic}: {facts}"

    def _notice(self, code: str, message: str, *, warning: bool = True) -> None:
        # The notice is an event like any other: it goes through the run's (async) log.
        self._spawn(self.run.emit_notice(code, message, warning=warning))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(work)
        if self._tasks is None:
            self._tasks = set()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the timer ------------------------------------------------------------------------

    def _arm(self) -> None:
        if self._asking_until != math.inf:
            soft_point = self._asking_until
        elif self.warned:
            soft_point = self._soft_at
        else:
            soft_point = self._soft_at - self._soft_span / 2
        self._timer = _alarms(self._loop).call_at(
            min(soft_point, self._hard_at, self._deadline_at), self._check)

    def _rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._arm()

    def _check(self) -> None:
        self._timer = None
        if self.run.finished or self.run.stop_requested:
            return
        # A timer may fire a hair early (the loop's clock resolution); then nothing below
        # is reached yet and it simply re-arms for the same moment.
        now = self._loop.time()
        if self._last_extend != self._seen_extend:
            # An extension since the last check pushed the soft deadline out.
            self._seen_extend = self._last_extend
            self.warned = False
            metrics.CRITIC_EXTENSIONS.inc()
            if self._rules is None:  # the rules judge: their extensions, counted per check
                metrics.CRITIC_VERDICTS.labels("extend", RULES).inc()
        idle = now - self._last_extend
        if now >= self._deadline_at:
            self._stop(CLIENT_DEADLINE, "the caller's deadline is reached")
            return
        if now >= self._hard_at:
            self._stop(HARD_TIMEOUT, f"the run reached its {_seconds(self.hard_timeout)} cap")
            return
        if now >= self._soft_at:
            if self._asking_until != math.inf:
                if now < self._asking_until:
                    self._arm()
                    return
                self._fall_back(f"did not answer within {_seconds(self._verdict_timeout)}")
                if self._timer is None:  # the rules' deadline may be past already
                    self._check()
                return
            judged_by = self.fallback
            if self._ask(idle):
                self._asking_until = now + self._verdict_timeout
                self._arm()
                return
            if self.fallback != judged_by:  # the critic broke when asked: the rules judge
                self._check()
                return
            self._stop(NO_PROGRESS, f"no progress for {_seconds(self._soft_span)}")
            return
        if idle >= self._soft_span / 2 and not self.warned:
            self._warn(idle)
        self._arm()

    def _ask(self, idle: float) -> bool:
        if self._rules is None:
            return False
        try:
            return bool(self._judge.ask(idle))
        except BaseException as exc:  # a critic's code (see _CRITICS_RAISE)
            log.exception("critic_ask_failed", critic=self.critic, run_id=self.run.run_id)
            self._fall_back(f"failed ({type(exc).__name__})")
            return False

    def _warn(self, idle: float) -> None:
        self.warned = True
        metrics.CRITIC_WARNINGS.inc()
        message = (f"no progress for {_seconds(idle)}; "
                   f"stopping at {_seconds(self._soft_span)}")
        log.info("critic_warning", run_id=self.run.run_id, tool=self.run.spec.name,
                 message=message)
        self._notice(NO_PROGRESS, message)

    def _stop(self, code: str, message: str) -> None:
        if self.run.stop(Outcome.TIMEOUT, code, message):
            _KILLS_BY_REASON[code].inc()
            log.warning("critic_stopped_run", run_id=self.run.run_id, tool=self.run.spec.name,
                        code=code, reason=message, progress_events=self.progress_events)

    def _on_finish(self, run: Run) -> None:
        del run
        if self.notices_left_out:
            log.info("critic_notices_left_out", critic=self.critic, run_id=self.run.run_id,
                     notices=self.notices_left_out)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self._judge.close()
        except BaseException:  # a critic's code (see _CRITICS_RAISE)
            log.exception("critic_close_failed", critic=self.critic)

