"""Lanes: when a run may start.

A lane is named capacity (``lanes`` in the settings: ``max_concurrent`` runs at once,
``max_queued`` waiting, a ``default_priority``); the lane ``default`` always exists. A run
goes to the lane the request names (only with ``lane_override_role``), else the one
``tool_lanes`` gives its tool, else the tool's own (``@tool(lane=…)``), else ``default``.

A run that finds its lane full **waits in the lane's queue** inside its own task, before its
START (a gate of the run, :attr:`stargrpc.runs.run.Run.gates`): it is published, listed
(state ``queued``), watchable and cancellable meanwhile. The order of the queue:

- a **higher priority** starts first (``priority`` of the request, else the tool's default,
  else the lane's; capped at ``priority_max_per_principal`` unless the caller has the admin
  role);
- within one priority, **principals take turns**: each entry gets a *turn*, the later of
  the turn after its principal's previous entry and the turn of the last entry that started
  (the priority's *virtual time*), and the queue is ordered by turn, then by arrival. A
  principal that queued 1,000 runs holds turns t … t+999; another that comes afterwards
  gets turn t (or the virtual time it has reached since) and starts next, not 1,001st:
  start-time fair queueing with a unit cost per run.

**The estimated wait** of a run at position *p* (1 = it starts next) in a lane of *c* slots:
with *d* the mean duration of the lane's last :data:`DURATION_HISTORY` runs, each running run
is expected to free its slot *d* after it started (now, when it is already late), so the
slots free up at ``r_1 ≤ … ≤ r_c`` from now (0 for a slot free now), and then every *d*:
``wait(p) = r_((p-1) mod c + 1) + ((p-1) div c) · d``. While the lane has no finished run
yet, *d* is the mean time its running runs have run so far (0 without any): the estimate is
then a lower bound.

This module holds the scheduling itself (:class:`LaneQueue`, pure and clock-driven), the
embedded board that keeps every lane of one process (:class:`LocalLanes`), the choice of a
run's lane and priority (:class:`LanePolicy`) and the gate a queued run waits in. A fleet
shares its lanes through the run store (the Redis room ``stargrpc.stores.redis.lanes``),
which implements :class:`LaneBoard` with the same ordering.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from stargrpc import metrics
from stargrpc.errors import (
    FieldViolation,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ToolDefinitionError,
    ToolFailed,
    reason_name,
)
from stargrpc.principal import Principal
from stargrpc.registry import ToolSpec
from stargrpc.runs.call_record import CallRecord
from stargrpc.runs.run import PHASE_QUEUED, Run
from stargrpc.settings import LaneConfig, Settings
from stargrpc.v1 import errors_pb2, events_pb2

log = structlog.get_logger("stargrpc.lanes")

#: The lane every server has.
DEFAULT_LANE = "default"
#: The highest priority anyone may ask for (the admin role included).
MAX_PRIORITY = 1000
#: Finished runs of a lane whose durations the estimate averages.
DURATION_HISTORY = 32
#: A queued run's notice is sent again when its position moved by at least this share of
#: the last one sent, or whenever it is at most :data:`NOTICE_EVERY_POSITION_UNDER`: a run
#: deep in a queue of thousands gets a dozen notices, not one per run that starts.
NOTICE_STEP_SHARE = 0.1
NOTICE_EVERY_POSITION_UNDER = 10

LANE_FULL = reason_name(errors_pb2.LANE_FULL)
LANE_BUSY = reason_name(errors_pb2.LANE_BUSY)
LANE_UNKNOWN = reason_name(errors_pb2.LANE_UNKNOWN)
LANE_OVERRIDE_NOT_ALLOWED = reason_name(errors_pb2.LANE_OVERRIDE_NOT_ALLOWED)
QUEUED = reason_name(errors_pb2.QUEUED)


@dataclass(frozen=True)
class LaneTicket:
    """What a run asks of its lane.

    Attributes:
        run_id: The run.
        lane: The lane's name.
        principal: Who runs it (whose turn it takes).
        priority: Its priority (higher first).
        max_wait: Refuse when the estimated wait is longer (seconds); 0: wait.
    """

    run_id: str
    lane: str
    principal: str
    priority: int
    max_wait: float = 0.0


@dataclass
class LanePlace:
    """A run's place in its lane: a slot (``granted``) or a place in the queue.

    Attributes:
        ticket: What the run asked for.
        granted: Whether it holds a slot (it may start).
        position: While queued: runs that start before it, plus one.
        estimate: While queued: the estimated wait in seconds, as of :attr:`position`.
        entered: When it entered the lane (``time.monotonic()``).
        started: When it got its slot (``time.monotonic()``); 0 while queued.
        changed: Set when it got its slot, or its position moved enough to tell.
        released: Whether it left the lane (its run ended, or left the queue).
    """

    ticket: LaneTicket
    granted: bool = False
    position: int = 0
    estimate: float = 0.0
    entered: float = field(default_factory=time.monotonic)
    started: float = 0.0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    released: bool = False
    #: The position the run's last notice told; what the next one is measured against.
    told: int = 0

    @property
    def waited(self) -> float:
        """Seconds it waited for its slot (so far, while queued)."""
        return (self.started or time.monotonic()) - self.entered

    def worth_telling(self) -> bool:
        """Whether its position moved enough since the last notice to send another."""
        if self.position == self.told:
            return False
        return (self.position < NOTICE_EVERY_POSITION_UNDER
                or abs(self.position - self.told) >= max(1, self.told * NOTICE_STEP_SHARE))


#: The least delay a refusal for a full queue tells its caller to wait: the estimate can be
#: a few milliseconds (no run of the lane has ended yet, so only how long the running ones
#: have run so far is known), and a caller honouring it would retry in a tight loop.
LANE_FULL_RETRY_FLOOR_SECONDS = 1.0


def lane_full(lane: str, max_queued: int, retry_after: float) -> ResourceExhausted:
    """The refusal of a run whose lane's queue is full: retry after the queue's estimated
    wait, and never sooner than :data:`LANE_FULL_RETRY_FLOOR_SECONDS`."""
    retry_after = max(retry_after, LANE_FULL_RETRY_FLOOR_SECONDS)
    return ResourceExhausted(
        f"the queue of lane {lane!r} is full (max_queued {max_queued}); retry after "
        f"{retry_after:.3g} s", retry_after=retry_after, reason=LANE_FULL,
        metadata={"lane": lane, "max_queued": str(max_queued)})


def lane_busy(lane: str, estimate: float, max_wait: float) -> ResourceExhausted:
    """The refusal of a run whose estimated wait is longer than its ``max_wait_seconds``."""
    return ResourceExhausted(
        f"the estimated wait in lane {lane!r} is {estimate:.3g} s, longer than "
        f"max_wait_seconds {max_wait:g}", retry_after=max(estimate, 0.001), reason=LANE_BUSY,
        metadata={"lane": lane, "estimated_wait_seconds": f"{estimate:.3f}",
                  "max_wait_seconds": f"{max_wait:g}"})


def estimate_wait(position: int, slots: int, durations: Iterable[float],
                  running_for: Iterable[float]) -> float:
    """The estimated wait of the run at ``position`` (see the module docstring).

    Args:
        position: 1 = it starts next.
        slots: The lane's ``max_concurrent`` (> 0).
        durations: The lane's recent run durations, in seconds.
        running_for: How long each of its running runs has run so far, in seconds.
    """
    history = list(durations)
    elapsed = list(running_for)
    if history:
        mean = sum(history) / len(history)
    elif elapsed:
        mean = sum(elapsed) / len(elapsed)
    else:
        return 0.0
    frees = sorted(max(0.0, mean - ran) for ran in elapsed)[:slots]
    frees += [0.0] * (slots - len(frees))
    rounds, index = divmod(max(1, position) - 1, slots)
    return frees[index] + rounds * mean


class LaneQueue:
    """One lane of one process: its slots, its queue in turn order, its recent durations.

    Attributes:
        name: The lane.
        config: Its limits.
        running: The places holding a slot, by run id.
        durations: The last run durations (seconds).
    """

    name: str
    config: LaneConfig
    running: dict[str, LanePlace]
    durations: deque[float]
    _order: list[tuple[int, int, int, str]]
    _waiting: dict[str, LanePlace]
    _virtual: dict[int, int]
    _next_turn: dict[tuple[int, str], int]
    _arrivals: int
    _clock: Callable[[], float]

    def __init__(self, name: str, config: LaneConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.config = config
        self.running = {}
        self.durations = deque(maxlen=DURATION_HISTORY)
        self._order = []
        self._waiting = {}
        self._virtual = {}
        self._next_turn = {}
        self._arrivals = 0
        self._clock = clock

    @property
    def depth(self) -> int:
        """Runs waiting."""
        return len(self._order)

    def estimate(self, position: int) -> float:
        """The estimated wait at ``position`` now."""
        now = self._clock()
        return estimate_wait(position, self.config.max_concurrent, self.durations,
                             (now - place.started for place in self.running.values()))

    def enter(self, ticket: LaneTicket) -> LanePlace:
        """A place for ``ticket``: a slot when one is free and nobody waits, else a place in
        the queue.

        Raises:
            ResourceExhausted: LANE_FULL, or LANE_BUSY when the estimated wait is longer
                than the ticket's ``max_wait``.
        """
        place = LanePlace(ticket, entered=self._clock())
        if len(self.running) < self.config.max_concurrent and not self._order:
            self._grant(place)
            return place
        if len(self._order) >= self.config.max_queued:
            raise lane_full(self.name, self.config.max_queued,
                            self.estimate(len(self._order) + 1))
        key = self._key_for(ticket)
        position = bisect.bisect_left(self._order, key) + 1
        estimate = self.estimate(position)
        if ticket.max_wait and estimate > ticket.max_wait:
            raise lane_busy(self.name, estimate, ticket.max_wait)
        self._take_turn(ticket, key)
        self._order.insert(position - 1, key)
        self._waiting[ticket.run_id] = place
        place.position, place.estimate = position, estimate
        return place

    def _key_for(self, ticket: LaneTicket) -> tuple[int, int, int, str]:
        """Where ``ticket`` sorts: priority (higher first), turn, arrival."""
        turn = max(self._virtual.get(ticket.priority, 0),
                   self._next_turn.get((ticket.priority, ticket.principal), 0))
        return (-ticket.priority, turn, self._arrivals, ticket.run_id)

    def _take_turn(self, ticket: LaneTicket, key: tuple[int, int, int, str]) -> None:
        self._next_turn[(ticket.priority, ticket.principal)] = key[1] + 1
        self._arrivals += 1

    def leave(self, place: LanePlace, *, ran: bool = True) -> list[LanePlace]:
        """Takes ``place`` out of the lane (its run ended, or gave up waiting); the places
        that got a slot through it.

        Args:
            ran: Whether a run that held a slot ran its tool (then its duration counts in
                the estimate).
        """
        if place.released:
            return []
        place.released = True
        run_id = place.ticket.run_id
        if self.running.pop(run_id, None) is not None:
            if ran:
                self.durations.append(self._clock() - place.started)
        elif self._waiting.pop(run_id, None) is not None:
            index = next(i for i, key in enumerate(self._order) if key[3] == run_id)
            del self._order[index]
        return self.fill()

    def fill(self) -> list[LanePlace]:
        """Gives free slots to the head of the queue; the places granted."""
        granted = []
        while self._order and len(self.running) < self.config.max_concurrent:
            key = self._order.pop(0)
            place = self._waiting.pop(key[3])
            # The priority's virtual time moves to the turn that starts now.
            self._virtual[-key[0]] = max(self._virtual.get(-key[0], 0), key[1])
            self._grant(place)
            granted.append(place)
        if granted:
            self._forget_turns()
        return granted

    def _forget_turns(self) -> None:
        """Drops principals' turns the virtual time has reached (they count for nothing)."""
        if len(self._next_turn) > 2 * len(self._waiting) + 64:
            self._next_turn = {key: turn for key, turn in self._next_turn.items()
                               if turn > self._virtual.get(key[0], 0)}

    def _grant(self, place: LanePlace) -> None:
        place.granted = True
        place.started = self._clock()
        place.position = 0
        self.running[place.ticket.run_id] = place
        place.changed.set()

    def reposition(self) -> None:
        """Brings every waiting place's position (and estimate) up to date, and wakes those
        whose position moved enough to tell."""
        for index, key in enumerate(self._order):
            place = self._waiting[key[3]]
            position = index + 1
            if position != place.position:
                place.position = position
                if place.worth_telling():
                    place.estimate = self.estimate(position)
                    place.changed.set()

    def where(self, run_id: str) -> LanePlace | None:
        """The place of a run waiting or running in the lane."""
        return self._waiting.get(run_id) or self.running.get(run_id)


class LaneBoard(Protocol):
    """Every lane as a server sees them: one process's (:class:`LocalLanes`) or the
    fleet's (in the run store)."""

    async def enter(self, ticket: LaneTicket) -> LanePlace:
        """A slot or a place in the queue for ``ticket``.

        Raises:
            ResourceExhausted: LANE_FULL or LANE_BUSY.
            Unavailable: A shared store is unreachable.
        """
        ...

    async def wait(self, place: LanePlace) -> None:
        """Returns when ``place`` changed: it got its slot, or its position moved enough to
        tell (then :attr:`LanePlace.position` and ``estimate`` say where it is)."""
        ...

    def leave(self, place: LanePlace, *, ran: bool) -> None:
        """Takes the place out of its lane (a slot freed, or a place in the queue given
        up); never raises (a shared store frees it within its lease)."""
        ...

    def where(self, run_id: str) -> LanePlace | None:
        """Where a run of this process waits or runs, if it is in a lane."""
        ...

    async def waiting(self, run_ids: list[str]) -> dict[str, tuple[str, int, int]]:
        """Which of ``run_ids`` wait in a lane, wherever they were admitted: run id →
        (lane, priority, position)."""
        ...


class LocalLanes:
    """The lanes of one process (the embedded default).

    Attributes:
        queues: Each configured lane's queue, by name.
    """

    queues: dict[str, LaneQueue]
    _repositioning: bool

    def __init__(self, lanes: Mapping[str, LaneConfig]) -> None:
        self.queues = {name: LaneQueue(name, config) for name, config in lanes.items()}
        self._repositioning = False

    async def enter(self, ticket: LaneTicket) -> LanePlace:
        queue = self.queues[ticket.lane]
        place = queue.enter(ticket)
        if not place.granted:
            self._later_reposition()
        return place

    async def wait(self, place: LanePlace) -> None:
        await place.changed.wait()
        place.changed.clear()

    def leave(self, place: LanePlace, *, ran: bool) -> None:
        queue = self.queues.get(place.ticket.lane)
        if queue is None:
            return
        waiting = not place.granted
        granted = queue.leave(place, ran=ran)
        if granted or waiting:
            self._later_reposition()

    def where(self, run_id: str) -> LanePlace | None:
        for queue in self.queues.values():
            place = queue.where(run_id)
            if place is not None:
                return place
        return None

    async def waiting(self, run_ids: list[str]) -> dict[str, tuple[str, int, int]]:
        found = {}
        for run_id in run_ids:
            place = self.where(run_id)
            if place is not None and not place.granted:
                found[run_id] = (place.ticket.lane, place.ticket.priority, place.position)
        return found

    def _later_reposition(self) -> None:
        # Once per turn of the loop however many runs entered or left meanwhile: a queue of
        # thousands is walked once, not once per change.
        if not self._repositioning:
            self._repositioning = True
            asyncio.get_running_loop().call_soon(self._reposition)

    def _reposition(self) -> None:
        self._repositioning = False
        for queue in self.queues.values():
            queue.reposition()
            metrics.LANE_QUEUE_DEPTH.labels(queue.name).set(queue.depth)


@dataclass(frozen=True)
class LaneChoice:
    """A run's lane and priority, as its request and tool decide them.

    Attributes:
        lane: The lane's name.
        priority: The run's priority in it.
        asked_priority: The priority the request asked for (0: none), before the cap.
        max_wait: The request's ``max_wait_seconds`` (0: wait).
    """

    lane: str
    priority: int
    asked_priority: int = 0
    max_wait: float = 0.0

    @property
    def capped(self) -> bool:
        """Whether the request asked for more than the caller may have."""
        return self.asked_priority > self.priority


class LanePolicy:
    """Which lane and priority a run gets, from the settings.

    Attributes:
        lanes: Every lane's limits (``default`` included).
        tool_lanes: Per tool, the lane configured for it.
        override_role: The role that may name a lane in the request.
        admin_role: The role that may exceed :attr:`priority_max`.
        priority_max: The highest priority others may ask for.
    """

    lanes: dict[str, LaneConfig]
    tool_lanes: dict[str, str]
    override_role: str
    admin_role: str
    priority_max: int

    def __init__(self, settings: Settings) -> None:
        self.lanes = {DEFAULT_LANE: LaneConfig(), **settings.lanes}
        self.tool_lanes = dict(settings.tool_lanes)
        self.override_role = settings.lane_override_role
        self.admin_role = settings.admin_role
        self.priority_max = settings.priority_max_per_principal

    @property
    def limited(self) -> dict[str, LaneConfig]:
        """The lanes that limit their runs (``max_concurrent`` > 0)."""
        return {name: config for name, config in self.lanes.items() if config.max_concurrent}

    def check_tools(self, specs: Iterable[ToolSpec]) -> None:
        """Refuses a catalog whose tool names a lane that is not configured.

        Raises:
            ToolDefinitionError: Naming the tool, where it is defined and the lane.
        """
        for spec in specs:
            if spec.lane and spec.lane not in self.lanes and spec.name not in self.tool_lanes:
                raise ToolDefinitionError(
                    f"{spec.source}: tool {spec.name!r} names lane {spec.lane!r}, which the "
                    f"lanes setting does not configure (configured: "
                    f"{', '.join(sorted(self.lanes))})")

    def choose(self, spec: ToolSpec, principal: Principal, *, lane: str = "",
               priority: int = 0, max_wait: float = 0.0) -> LaneChoice:
        """The lane and priority of a run of ``spec`` by ``principal``, with what the
        request asked for.

        Raises:
            InvalidArgument: A negative or too large priority, a negative or non-finite
                ``max_wait_seconds``, an unknown lane.
            PermissionDenied: A lane named without ``lane_override_role``.
        """
        if not lane and not priority and not max_wait:
            # What most requests ask: nothing. The tool's lane and priority, no checks.
            name = self.tool_lanes.get(spec.name) or spec.lane or DEFAULT_LANE
            return LaneChoice(name, spec.default_priority or self.lanes[name].default_priority)
        violations = []
        if priority < 0 or priority > MAX_PRIORITY:
            violations.append(FieldViolation("priority", f"must be 0 to {MAX_PRIORITY} "
                                             "(0: the tool's or the lane's default)"))
        if not 0 <= max_wait < float("inf"):  # NaN fails too
            violations.append(FieldViolation("max_wait_seconds",
                                             "must be a finite number of seconds, 0 or more"))
        if lane and lane not in self.lanes:
            shown = lane if len(lane) <= 64 else lane[:64] + "…"
            violations.append(FieldViolation("lane", f"unknown lane {shown!r}"))
        if violations:
            error = InvalidArgument("; ".join(f"{v.field}: {v.description}"
                                              for v in violations), violations)
            if any(v.field == "lane" for v in violations):
                error.reason = LANE_UNKNOWN
            raise error
        if lane and not principal.has_role(self.override_role):
            raise PermissionDenied(
                f"naming a lane needs the role {self.override_role!r}",
                reason=LANE_OVERRIDE_NOT_ALLOWED, metadata={"lane": lane})
        name = lane or self.tool_lanes.get(spec.name) or spec.lane or DEFAULT_LANE
        config = self.lanes[name]
        chosen = priority or spec.default_priority or config.default_priority
        if priority and priority > self.priority_max and not principal.has_role(self.admin_role):
            chosen = self.priority_max
        return LaneChoice(name, chosen, asked_priority=priority, max_wait=max_wait)


def _describe(place: LanePlace) -> str:
    ticket = place.ticket
    wait = f"about {place.estimate:.3g} s" if place.estimate else "unknown yet"
    return (f"queued in lane {ticket.lane!r} at position {place.position} (priority "
            f"{ticket.priority}); estimated wait {wait}")


def _queued_detail(place: LanePlace) -> Callable[[events_pb2.Notice], None]:
    def fill(notice: events_pb2.Notice) -> None:
        queued = notice.queued
        queued.lane = place.ticket.lane
        queued.position = place.position
        queued.priority = place.ticket.priority
        queued.estimated_wait.FromNanoseconds(int(place.estimate * 1e9))
    return fill


class LaneGate:
    """The gate a run passes before its START (:attr:`Run.gates`): waits for the run's
    slot in its lane, telling the run's stream where it waits.

    A run enters its lane when it is admitted, so that a full lane refuses the call itself
    (LANE_FULL, LANE_BUSY). A run that waits at an earlier gate first (a person's approval)
    enters only when it reaches this one: a wait of minutes must not hold a slot, nor a
    place that others would queue behind. Its lane's refusal is then its Result
    (``Result{FAILED, LANE_FULL}``).

    Attributes:
        board: The lanes.
        ticket: What the run asks of its lane.
        place: The run's place (a slot, or a place in the queue); None until it enters.
        record: The audit record of the call that started the run, if any.
    """

    board: LaneBoard
    ticket: LaneTicket
    place: LanePlace | None
    record: CallRecord | None

    def __init__(self, board: LaneBoard, ticket: LaneTicket, place: LanePlace | None,
                 record: CallRecord | None) -> None:
        self.board = board
        self.ticket = ticket
        self.place = place
        self.record = record

    def leave(self, run: Run) -> None:
        """Gives the run's place back when it ends (a finish hook of the run)."""
        if self.place is not None:
            self.board.leave(self.place, ran=self.place.granted)

    async def __call__(self, run: Run) -> None:
        """Waits for the slot; leaves the queue when the wait is cancelled (the run was
        stopped: CancelRun, the caller's deadline or cancel, shutdown).

        Raises:
            ToolFailed: The run entered its lane here, and the lane refused it.
        """
        if self.place is None:
            try:
                self.place = await self.board.enter(self.ticket)
            except ResourceExhausted as refused:
                metrics.LANE_REFUSALS.labels(self.ticket.lane, refused.reason.lower()).inc()
                raise ToolFailed(refused.message, code=refused.reason) from None
        place = self.place
        lane = place.ticket.lane
        if not place.granted:
            run.phase = PHASE_QUEUED
            try:
                await _tell(run, place)
                while not place.granted:
                    await self.board.wait(place)
                    if not place.granted and place.worth_telling():
                        await _tell(run, place)
            except BaseException:
                self.board.leave(place, ran=False)
                raise
            log.info("lane_wait_ended", run_id=run.run_id, lane=lane,
                     waited_seconds=round(place.waited, 3))
        waited = place.waited if place.started else 0.0
        metrics.LANE_WAIT_SECONDS.labels(lane).observe(waited)
        if self.record is not None:
            self.record.extra["lane"] = (f"{lane}, priority {place.ticket.priority}, "
                                         f"waited {waited:.3f} s")


async def _tell(run: Run, place: LanePlace) -> None:
    """Tells the run's stream where it waits (a QUEUED notice)."""
    place.told = place.position
    await run.emit_notice(QUEUED, _describe(place), warning=False,
                          detail=_queued_detail(place))
