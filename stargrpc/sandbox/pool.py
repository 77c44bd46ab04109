"""The warm pool: sandboxes started ahead of need, each handed to exactly one run.

A server with sandboxed tools keeps ``sandbox_warm_pool`` sandboxes of each warm kind it
needs ready (``python`` for the python tool, ``exec`` for the shell tool; see
:mod:`stargrpc.sandbox.warm`), per process: under ``serve --workers N`` each worker keeps
its own. A run whose command, environment, limits, isolation and folders shown match a
ready one takes it (the oldest first), and the run's state socket adopts the one the pooled
sandbox was started with (see :class:`~stargrpc.sandbox.warm.WarmKind`); it is never given
to another run, and is destroyed when its run ends.
The refill starts replacements in the background, one at a time, once the run that took
one has ended (its processes gone, its output read, its folder removed: its Result gone
out a moment before) and a moment more, or a second after the hand-out at the latest, so
that starting the next sandbox does not take CPU from the run it would serve.
When none is ready (a burst emptied the pool, or it is still filling) the run starts its
own sandbox on demand, as it would with no pool.

A ready sandbox whose process exits while it waits is destroyed and replaced at once. One
that was touched while it waited (see :meth:`WarmSandbox.unfit`) or does not answer the
hand-out's nonce is destroyed when a run asks for it, as is one whose folder the run's input
files could not be written into (a full disk): the run takes the next one, or starts its
own. Nothing waits on a sandbox that cannot start: the refill backs off (doubling up to
:data:`MAX_BACKOFF_SECONDS`) and runs start on demand meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import structlog

from stargrpc.metrics import POOL_DISCARDED, POOL_HANDOUTS, POOL_MISSES, POOL_READY
from stargrpc.sandbox import runner
from stargrpc.sandbox.runner import AdoptState, Sandbox, WarmStart
from stargrpc.sandbox.warm import Unfit, WarmKind, WarmSandbox, kinds_for
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.sandbox")

#: Longest wait between two attempts at starting a warm sandbox after failures.
MAX_BACKOFF_SECONDS = 30.0
#: After a hand-out, the refill waits for the run to end, then this long ...
REFILL_SETTLE_SECONDS = 0.02
#: ... or this long at most, whichever comes first.
REFILL_AFTER_SECONDS = 1.0


class _Lane:
    """The ready sandboxes of one kind, and the task that keeps them topped up."""

    kind: WarmKind
    ready: deque[WarmSandbox]
    wake: asyncio.Event
    filled: asyncio.Event
    task: asyncio.Task[None] | None

    def __init__(self, kind: WarmKind) -> None:
        self.kind = kind
        self.ready = deque()
        self.wake = asyncio.Event()
        self.filled = asyncio.Event()
        self.task = None


class WarmPool:
    """Sandboxes of the given kinds started ahead, ``size`` of each (see the module
    docstring). :meth:`start` begins filling and lets runs of this process take from it;
    :meth:`aclose` destroys every sandbox it still holds.

    Attributes:
        size: Ready sandboxes kept per kind.
        kinds: The kinds kept, by name.
    """

    size: int
    kinds: dict[str, WarmKind]
    _sandbox: Sandbox
    _key: tuple[object, ...]
    _lanes: dict[str, _Lane]
    _closing: bool
    _chores: set[asyncio.Task[None]]

    def __init__(self, settings: Settings, kinds: Iterable[str], size: int) -> None:
        """
        Args:
            settings: The server's settings (its sandbox configuration).
            kinds: The warm kinds to keep ("python", "exec").
            size: Ready sandboxes to keep of each.

        Raises:
            RuntimeError: The configured isolation does not work here.
        """
        every = kinds_for(settings)
        self.size = size
        self.kinds = {name: every[name] for name in kinds}
        self._sandbox = Sandbox(settings)
        self._key = self._sandbox.start_key()
        self._lanes = {name: _Lane(kind) for name, kind in self.kinds.items()}
        self._closing = False
        self._chores = set()

    def start(self) -> None:
        """Starts filling, and offers the pool to this process's runs."""
        for lane in self._lanes.values():
            POOL_READY.labels(lane.kind.name).set(0)
            lane.task = asyncio.create_task(self._refill(lane))
        runner.warm_sources.append(self.take)
        log.info("sandbox_warm_pool_started", size=self.size, kinds=sorted(self._lanes))

    def ready(self, kind: str) -> int:
        """How many sandboxes of ``kind`` are ready now."""
        return len(self._lanes[kind].ready)

    def waiting(self, kind: str) -> list[WarmSandbox]:
        """The ready sandboxes of ``kind``, the next to be handed out first (for
        inspection: what the pool holds)."""
        return list(self._lanes[kind].ready)

    async def filled(self) -> None:
        """Returns once every kind has ``size`` sandboxes ready (at that moment)."""
        for lane in self._lanes.values():
            while len(lane.ready) < self.size:
                lane.filled.clear()
                await lane.filled.wait()

    async def take(self, sandbox: Sandbox, argv: list[str], env: Mapping[str, str],
                   files: Mapping[str, str | bytes], pass_fds: tuple[int, ...] = (),
                   read_only_paths: tuple[Path, ...] = (),
                   adopt_state: AdoptState | None = None
                   ) -> WarmStart | None:
        """A ready sandbox, handed to the run of ``argv``, when one fits it exactly; None
        when none does (the run starts its own). A run whose one descriptor ``pass_fds``
        is its state socket takes a sandbox started with a state socket of its own, which
        ``adopt_state`` (the run's state socket's ``adopt``) then serves as the run's."""
        if self._closing or sandbox.start_key() != self._key:
            return None
        for lane in self._lanes.values():
            handed = lane.kind.match(argv, env, files, pass_fds, read_only_paths,
                                     adoptable=adopt_state is not None)
            if handed is None:
                continue
            adopt = adopt_state if lane.kind.takes_state else None
            while lane.ready:
                warm = lane.ready.popleft()
                self._changed(lane, refill=False)
                try:
                    started = await warm.hand_out(handed, files, sandbox.limits, adopt)
                except Unfit as exc:
                    self._discard(warm, exc.reason, str(exc))
                    self._changed(lane)
                    if exc.reason == "setup_failed":
                        # The disk, not the sandbox: the next would fail the same way, and
                        # the run's own start says what is wrong.
                        break
                    continue
                except BaseException:
                    # Cancelled (or failed) mid-hand-out: it belongs to no run; destroy it.
                    self._discard(warm, "abandoned", "the run was cancelled at hand-out")
                    self._changed(lane)
                    raise
                POOL_HANDOUTS.labels(lane.kind.name).inc()
                self._refill_after(lane, started)
                return started
            POOL_MISSES.labels(lane.kind.name).inc()
            return None
        return None

    async def aclose(self) -> None:
        """Stops refilling and destroys every sandbox it holds, then waits for the
        folders of the runs that have returned to be removed; safe to call more than
        once. Sandboxes already handed out belong to their runs."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(ValueError):
            runner.warm_sources.remove(self.take)
        for lane in self._lanes.values():
            lane.wake.set()  # a refill that missed its cancellation still sees the close
            if lane.task is not None:
                lane.task.cancel()
        for lane in self._lanes.values():
            if lane.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await lane.task
            while lane.ready:
                self._discard(lane.ready.popleft(), None, "")
            POOL_READY.labels(lane.kind.name).set(0)
        while self._chores:
            await asyncio.gather(*list(self._chores), return_exceptions=True)
        # The folders of the last runs, removed as their Results went out.
        await runner.removals()
        log.info("sandbox_warm_pool_stopped")

    def _changed(self, lane: _Lane, *, refill: bool = True) -> None:
        POOL_READY.labels(lane.kind.name).set(len(lane.ready))
        if len(lane.ready) >= self.size:
            lane.filled.set()
        elif refill:
            lane.wake.set()

    def _refill_after(self, lane: _Lane, handed: WarmStart) -> None:
        """Wakes the refill once the run just handed a sandbox has ended (its folder read
        and removed; and a moment more, for its Result to go out), or after
        :data:`REFILL_AFTER_SECONDS` at the latest: starting a sandbox costs CPU that the
        run itself would otherwise share, on a machine with few cores (a burst that
        empties the pool meanwhile starts its sandboxes on demand, as always)."""
        loop = asyncio.get_running_loop()
        latest = loop.call_later(REFILL_AFTER_SECONDS, lane.wake.set)

        def ended(_: object) -> None:
            latest.cancel()
            loop.call_later(REFILL_SETTLE_SECONDS, lane.wake.set)

        handed.ended.add_done_callback(ended)

    def _discard(self, warm: WarmSandbox, reason: str | None, detail: str) -> None:
        """Destroys ``warm`` in the background (counted and logged under ``reason``)."""
        if reason is not None:
            POOL_DISCARDED.labels(warm.kind.name, reason).inc()
            log.warning("sandbox_warm_discarded", kind=warm.kind.name, reason=reason,
                        detail=detail, pid=warm.pid)
        chore = asyncio.create_task(warm.aclose())
        self._chores.add(chore)
        chore.add_done_callback(self._chores.discard)

    def _died(self, lane: _Lane, warm: WarmSandbox, _: object = None) -> None:
        """Its process exited while it waited: out of the pool, destroyed, replaced."""
        if self._closing or warm not in lane.ready:
            return
        lane.ready.remove(warm)
        self._changed(lane)
        self._discard(warm, "died", "its process exited while it waited")

    async def _refill(self, lane: _Lane) -> None:
        backoff = 0.5
        while not self._closing:
            if len(lane.ready) >= self.size:
                lane.filled.set()
                lane.wake.clear()
                await lane.wake.wait()
                continue
            began = time.monotonic()
            try:
                warm = await WarmSandbox.start(self._sandbox, lane.kind)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: runs start on demand meanwhile
                log.error("sandbox_warm_start_failed", kind=lane.kind.name, error=str(exc),
                          retry_in_seconds=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                continue
            backoff = 0.5
            if self._closing:
                self._discard(warm, None, "")
                return
            if warm.exited.done():  # died between its ready and now
                self._discard(warm, "died", "its process exited before it was pooled")
                continue
            lane.ready.append(warm)
            warm.exited.add_done_callback(functools.partial(self._died, lane, warm))
            self._changed(lane)
            log.debug("sandbox_warm_ready", kind=lane.kind.name, pid=warm.pid,
                      start_seconds=round(time.monotonic() - began, 4))


#: The warm kind each bundled sandboxed tool runs in.
KIND_OF_TOOL = {"python": "python", "shell": "exec"}


async def start_pool(settings: Settings, tool_names: Iterable[str]) -> WarmPool | None:
    """The warm pool a server with these tools keeps, started; None when it keeps none
    (``sandbox_warm_pool`` is 0, no tool runs in a warm kind, or sandboxed tools are
    refused here: the policy's refusal is what their runs report)."""
    from stargrpc.sandbox.policy import decide  # policy imports the audit and auth stores

    size = settings.sandbox_warm_pool_size
    kinds = sorted({KIND_OF_TOOL[name] for name in tool_names if name in KIND_OF_TOOL})
    if size == 0 or not kinds:
        return None
    policy = await asyncio.to_thread(decide, settings)
    if policy.refusal is not None:
        return None
    try:
        pool = await asyncio.to_thread(WarmPool, settings, kinds, size)
    except (RuntimeError, OSError) as exc:
        log.error("sandbox_warm_pool_unavailable", error=str(exc))
        return None
    pool.start()
    return pool
