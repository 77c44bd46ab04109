"""The critic: a per-run supervisor whose deadline extends while the run makes progress.

Every supervised run has three limits, and the first one reached stops it:

- a **soft deadline** (``critic_soft_timeout``, or the tool's own ``soft_timeout``) that
  restarts whenever the run shows *progress*: a step starting or ending, a DELTA with
  content, a file chunk, a heartbeat whose progress value rises above the highest seen, or a
  heartbeat whose message differs from the previous one. A bare repeated heartbeat keeps the
  stream alive but is not progress — a stuck tool that pings forever is still caught. The
  run's first event (the START of its top-level step) is progress, so the count begins when
  the run does. At half the soft deadline without progress the run gets a warning notice;
  at the deadline it is stopped with ``Result{TIMEOUT}`` and code ``CRITIC_NO_PROGRESS``;
- a **hard cap** (``critic_hard_timeout``) on the total run time, progress or not
  (code ``CRITIC_HARD_TIMEOUT``);
- the **caller's gRPC deadline**, which always wins: the run is stopped just before it
  passes (code ``CLIENT_DEADLINE``), so a run never outlives the call that started it.

Stopping goes through :meth:`stargrpc.run.Run.stop`, which cancels the tool (a tool that runs
child processes kills them on cancellation) and still ends the run with the top-level END
(error) and a Result carrying the output produced so far. Every event of a supervised run
carries ``critic_time_left``: the time before the critic would stop the run if nothing else
happened.

**The seam.** The run is created inside the service handler, below the interceptors, so the
critic interceptor (:mod:`stargrpc.interceptors.critic`) does not see it. Instead it sets
:data:`current_supervision` to the :class:`SupervisionPolicy` of the call (the configured
timeouts and the call's deadline); :func:`supervise_launched_run`, registered as a
``Runtime.launch_hooks`` hook by the server, reads it when the run is launched — in the same
task, hence the same context — and attaches a :class:`Supervisor`. A run launched without a
policy (no critic interceptor in the chain) is not supervised and its events carry no
``critic_time_left``.

**Cost.** The supervisor is one ``run.observers`` callback per event (a few comparisons and
one Duration stamp) plus a single ``loop.call_at`` timer per run. Progress only records a
timestamp; the timer is not rescheduled per event. When it fires it looks at the latest
progress and either acts (warn, stop) or re-arms itself for the next point that matters, so
a run that streams thousands of deltas a second costs no timer churn.
"""

from __future__ import annotations

import asyncio
import math
from contextvars import ContextVar
from dataclasses import dataclass

import structlog

from stargrpc import metrics
from stargrpc.outcome import Outcome
from stargrpc.registry import ToolSpec
from stargrpc.run import Run
from stargrpc.v1 import events_pb2

log = structlog.get_logger("stargrpc.critic")

#: Codes of the critic's notices and of the Results of the runs it stops.
NO_PROGRESS = "CRITIC_NO_PROGRESS"
HARD_TIMEOUT = "CRITIC_HARD_TIMEOUT"
CLIENT_DEADLINE = "CLIENT_DEADLINE"

#: How long before the caller's deadline the run is stopped, so that the stopped run's
#: Result can still reach the caller instead of a bare DEADLINE_EXCEEDED.
CLIENT_DEADLINE_MARGIN = 0.05

# The longest time left stamped on an event (a Duration holds at most ~10,000 years; absurd
# configured timeouts must not make stamping fail).
_MAX_TIME_LEFT = 10 * 365 * 24 * 3600.0
_DELTA = events_pb2.STEP_PHASE_DELTA

_KILLS_BY_REASON = {
    NO_PROGRESS: metrics.CRITIC_KILLS.labels("no_progress"),
    HARD_TIMEOUT: metrics.CRITIC_KILLS.labels("hard_timeout"),
    CLIENT_DEADLINE: metrics.CRITIC_KILLS.labels("client_deadline"),
}


@dataclass(frozen=True)
class SupervisionPolicy:
    """How one call's run is supervised.

    Attributes:
        soft_timeout: Seconds without progress before the run is stopped (a tool's own
            ``soft_timeout`` takes precedence).
        hard_timeout: Seconds the run may take at most, progress or not.
        deadline: The caller's gRPC deadline as an event-loop time (``loop.time()``), or
            None when the call has no deadline.
    """

    soft_timeout: float
    hard_timeout: float
    deadline: float | None = None

    def soft_timeout_for(self, spec: ToolSpec) -> float:
        """The soft timeout that applies to a run of ``spec``."""
        return spec.soft_timeout if spec.soft_timeout else self.soft_timeout


#: The supervision policy of the call being served; set by the critic interceptor, read
#: when the call launches its run.
current_supervision: ContextVar[SupervisionPolicy | None] = ContextVar(
    "stargrpc_supervision", default=None)


def supervise_launched_run(run: Run) -> None:
    """A ``Runtime.launch_hooks`` hook: supervises ``run`` when the call has a policy."""
    policy = current_supervision.get()
    if policy is not None:
        Supervisor(run, policy).start()


def _seconds(value: float) -> str:
    return f"{round(value, 2):g} s"


class Supervisor:
    """Supervises one run; see the module docstring for the rules.

    Attributes:
        run: The supervised run.
        soft_timeout: Seconds without progress allowed.
        hard_timeout: Seconds in total allowed.
        progress_events: How many events counted as progress so far.
        warned: Whether the no-progress warning went out since the last progress.
    """

    run: Run
    soft_timeout: float
    hard_timeout: float
    progress_events: int
    warned: bool
    _loop: asyncio.AbstractEventLoop
    _hard_at: float
    _deadline_at: float
    _last_progress: float
    _seen_progress: float
    _best_progress_value: float
    _heartbeat_message: str
    _timer: asyncio.TimerHandle | None
    _tasks: set[asyncio.Task[None]]

    def __init__(self, run: Run, policy: SupervisionPolicy) -> None:
        self.run = run
        self.soft_timeout = policy.soft_timeout_for(run.spec)
        self.hard_timeout = policy.hard_timeout
        self.progress_events = 0
        self.warned = False
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self._hard_at = now + self.hard_timeout
        self._deadline_at = (math.inf if policy.deadline is None
                             else policy.deadline - CLIENT_DEADLINE_MARGIN)
        self._last_progress = now
        self._seen_progress = now
        self._best_progress_value = -math.inf
        self._heartbeat_message = ""
        self._timer = None
        self._tasks = set()

    def start(self) -> None:
        """Hooks into the run (observer, finish hook) and arms the timer."""
        self.run.observers.append(self.observe)
        self.run.finish_hooks.append(self._on_finish)
        self._arm()

    # -- the hot path: one call per event -------------------------------------------------

    def observe(self, event: events_pb2.RunEvent) -> None:
        """Records progress shown by ``event`` and stamps ``critic_time_left`` on it."""
        # Called once per event: written for speed (one field lookup of each kind, the
        # Duration fields set directly), with the rules in _is_progress.
        if self.run.stop_requested:
            # The run is ending (the steps closing now are not progress): nothing is left.
            event.critic_time_left.SetInParent()
            return
        now = self._loop.time()
        if self._is_progress(event):
            self._last_progress = now
            self.progress_events += 1
        limit = min(self._last_progress + self.soft_timeout, self._hard_at, self._deadline_at)
        left = limit - now
        # Whole milliseconds: plenty for a countdown, and shorter on the wire.
        millis = 0 if left <= 0 else int(min(left, _MAX_TIME_LEFT) * 1000 + 0.5)
        stamp = event.critic_time_left
        stamp.seconds, rest = divmod(millis, 1000)
        stamp.nanos = rest * 1_000_000

    def _is_progress(self, event: events_pb2.RunEvent) -> bool:
        kind = event.WhichOneof("kind")
        if kind == "step":
            # START/END of any step, and a DELTA only when it says something.
            step = event.step
            return step.phase != _DELTA or bool(step.delta)
        if kind == "heartbeat":
            beat = event.heartbeat
            moved = False
            if beat.HasField("progress") and beat.progress > self._best_progress_value:
                self._best_progress_value = beat.progress
                moved = True
            if beat.message != self._heartbeat_message:
                self._heartbeat_message = beat.message
                moved = True
            return moved
        return kind == "file_chunk"

    def time_left(self, now: float | None = None) -> float:
        """Seconds before the critic stops the run if no progress comes."""
        now = self._loop.time() if now is None else now
        limit = min(self._last_progress + self.soft_timeout, self._hard_at, self._deadline_at)
        return max(0.0, limit - now)

    # -- the timer ------------------------------------------------------------------------

    def _arm(self) -> None:
        idle_limit = self.soft_timeout if self.warned else self.soft_timeout / 2
        when = min(self._last_progress + idle_limit, self._hard_at, self._deadline_at)
        self._timer = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        self._timer = None
        if self.run.finished or self.run.stop_requested:
            return
        # A timer may fire a hair early (the loop's clock resolution); then nothing below
        # is reached yet and it simply re-arms for the same moment.
        now = self._loop.time()
        if self._last_progress != self._seen_progress:
            # Progress since the last check pushed the soft deadline out.
            self._seen_progress = self._last_progress
            self.warned = False
            metrics.CRITIC_EXTENSIONS.inc()
        idle = now - self._last_progress
        if now >= self._deadline_at:
            self._stop(CLIENT_DEADLINE, "the caller's deadline is reached")
        elif now >= self._hard_at:
            self._stop(HARD_TIMEOUT, f"the run reached its {_seconds(self.hard_timeout)} cap")
        elif idle >= self.soft_timeout:
            self._stop(NO_PROGRESS, f"no progress for {_seconds(self.soft_timeout)}")
        else:
            if idle >= self.soft_timeout / 2 and not self.warned:
                self._warn(idle)
            self._arm()

    def _warn(self, idle: float) -> None:
        self.warned = True
        metrics.CRITIC_WARNINGS.inc()
        message = (f"no progress for {_seconds(idle)}; "
                   f"stopping at {_seconds(self.soft_timeout)}")
        log.info("critic_warning", run_id=self.run.run_id, tool=self.run.spec.name,
                 message=message)
        # The notice is an event like any other: it goes through the run's (async) log.
        task = self._loop.create_task(self.run.emit_notice(NO_PROGRESS, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _stop(self, code: str, message: str) -> None:
        if self.run.stop(Outcome.TIMEOUT, code, message):
            _KILLS_BY_REASON[code].inc()
            log.warning("critic_stopped_run", run_id=self.run.run_id, tool=self.run.spec.name,
                        code=code, reason=message, progress_events=self.progress_events)

    def _on_finish(self, run: Run) -> None:
        del run
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
