"""The sessions of one server: made, found for their owner, capped, and closed on time.

:class:`Sessions` is what the service's CreateSession / CloseSession / ListSessions and an
Execute with a ``session_id`` reach. A session belongs to the principal that created it:
to anyone else it does not exist (NOT_FOUND, SESSION_NOT_FOUND — the same answer as for an
unknown, closed or expired one, so ids cannot be probed). Caps: ``session_max_per_principal``
and ``session_max_total`` (sessions being started count); each session's TTL and idle time
close it (a reaper task wakes at the earliest deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import structlog

from stargrpc.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    reason_name,
)
from stargrpc.sandbox.policy import decide
from stargrpc.sandbox.runner import Sandbox, WorkdirUnavailable, setup_failed_message
from stargrpc.sessions.forwarding import SessionDirectory
from stargrpc.sessions.session import (
    KINDS,
    Session,
    SessionClosed,
    SessionHandle,
    SessionLimits,
    SessionLost,
)
from stargrpc.settings import Settings
from stargrpc.v1 import errors_pb2

log = structlog.get_logger("stargrpc.sessions")

#: Longest session id accepted in a request (ours are 36 characters).
MAX_ID_LENGTH = 64

_BUSY = reason_name(errors_pb2.SESSION_BUSY)
_KIND_MISMATCH = reason_name(errors_pb2.SESSION_KIND_MISMATCH)


class Sessions:
    """The sessions of this server, by id.

    Attributes:
        settings: The server's settings (caps and limits).
    """

    settings: Settings
    _sessions: dict[str, Session]
    _starting: dict[str, int]
    _changed: asyncio.Event
    _reaper: asyncio.Task[None] | None
    _closing: set[asyncio.Task[None]]
    #: The fleet's record of where sessions live (None: this replica alone knows them).
    directory: SessionDirectory | None

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._sessions = {}
        self._starting = {}
        self._changed = asyncio.Event()
        self._reaper = None
        self._closing = set()
        self.directory = None

    # -- create -----------------------------------------------------------------------------

    def grant(self, kind: str, *, ttl_seconds: float = 0, idle_seconds: float = 0,
              memory_mb: int = 0, cpu_seconds: int = 0, disk_mb: int = 0) -> SessionLimits:
        """The limits a request for a session gets: each 0 is the server's, each above it
        refused.

        Raises:
            InvalidArgument: An unknown kind, or a value above the server's.
        """
        s = self.settings
        violations = []
        if kind not in KINDS:
            shown = kind if len(kind) <= 40 else kind[:40] + "…"
            violations.append(FieldViolation("kind", f"{shown!r} is not one of "
                                                     f"{', '.join(KINDS)}"))
        asked = {"ttl_seconds": (ttl_seconds, s.session_ttl_seconds),
                 "idle_seconds": (idle_seconds, s.session_idle_seconds),
                 "memory_mb": (memory_mb, s.session_memory_mb),
                 "cpu_seconds": (cpu_seconds, s.session_cpu_seconds),
                 "disk_mb": (disk_mb, s.session_disk_mb)}
        for name, (value, most) in asked.items():
            if value < 0 or value > most:
                violations.append(FieldViolation(name, f"at most {most:g} on this server "
                                                       "(0: that)"))
        if violations:
            raise InvalidArgument("the session cannot be made as asked", violations)

        def pick(name: str) -> float:
            value, most = asked[name]
            return value or most

        return SessionLimits(ttl_seconds=pick("ttl_seconds"),
                             idle_seconds=pick("idle_seconds"),
                             memory_mb=int(pick("memory_mb")),
                             cpu_seconds=int(pick("cpu_seconds")),
                             disk_mb=int(pick("disk_mb")))

    async def create(self, owner: str, kind: str, limits: SessionLimits) -> Session:
        """Starts a session for ``owner``.

        Raises:
            ResourceExhausted: The caller's or the server's cap is reached (SESSION_LIMIT).
            FailedPrecondition: The sandbox cannot run here (SANDBOX_UNAVAILABLE), or the
                interpreter did not start.
        """
        self._reserve(owner)
        try:
            policy = await asyncio.to_thread(decide, self.settings)
            if policy.refusal is not None:
                raise FailedPrecondition(policy.refusal, reason="SANDBOX_UNAVAILABLE")
            try:
                sandbox = Sandbox(self.settings, limits.sandbox_limits(self.settings))
            except (RuntimeError, OSError) as exc:
                raise FailedPrecondition(f"the sandbox is unavailable: {exc}",
                                         reason="SANDBOX_UNAVAILABLE") from exc
            session = Session(kind, owner, limits, self.settings, on_closed=self._forget,
                              on_used=self._wake)
            try:
                await session.start(sandbox, self.settings.sandbox_python)
            except SessionLost as exc:
                raise FailedPrecondition(exc.message, reason="SANDBOX_UNAVAILABLE") from exc
            except WorkdirUnavailable as exc:  # its folder could not be made: a full disk
                raise FailedPrecondition(setup_failed_message(exc),
                                         reason="SANDBOX_UNAVAILABLE") from exc
        finally:
            self._release(owner)
        self._sessions[session.session_id] = session
        self._wake()
        if self.directory is not None:
            try:
                await self.directory.claim(session.session_id, owner, limits.ttl_seconds)
            except Exception:  # the session works here; other replicas will not find it
                log.warning("session_not_recorded", session_id=session.session_id,
                            exc_info=True)
        log.info("session_created", session_id=session.session_id, kind=kind, owner=owner)
        return session

    def _reserve(self, owner: str) -> None:
        s = self.settings
        if s.session_max_per_principal == 0:
            raise FailedPrecondition("sessions are turned off on this server "
                                     "(session_max_per_principal=0)", reason="SESSION_LIMIT")
        mine = sum(1 for x in self._sessions.values() if x.owner == owner)
        mine += self._starting.get(owner, 0)
        if mine >= s.session_max_per_principal:
            raise ResourceExhausted(
                f"the caller holds {mine} sessions, the most allowed; close one first",
                reason="SESSION_LIMIT", retry_after=5.0,
                metadata={"limit": str(s.session_max_per_principal)})
        if len(self._sessions) + sum(self._starting.values()) >= s.session_max_total:
            raise ResourceExhausted("the server holds as many sessions as it allows",
                                    reason="SESSION_LIMIT", retry_after=5.0,
                                    metadata={"limit": str(s.session_max_total)})
        self._starting[owner] = self._starting.get(owner, 0) + 1

    def _release(self, owner: str) -> None:
        left = self._starting.get(owner, 0) - 1
        if left > 0:
            self._starting[owner] = left
        else:
            self._starting.pop(owner, None)

    # -- find, list, close ------------------------------------------------------------------

    def get(self, owner: str, session_id: str) -> Session:
        """The session ``session_id`` when ``owner`` holds it.

        Raises:
            NotFound: Unknown, closed, expired, or another principal's (SESSION_NOT_FOUND).
        """
        session = (self._sessions.get(session_id) if len(session_id) <= MAX_ID_LENGTH
                   else None)
        if session is None or session.owner != owner or session.closed is not None:
            raise NotFound("unknown session (or closed, or expired, or not yours)",
                           reason="SESSION_NOT_FOUND")
        if session.deadline() <= time.time():
            raise NotFound("unknown session (or closed, or expired, or not yours)",
                           reason="SESSION_NOT_FOUND")
        return session

    def for_call(self, owner: str, session_id: str, tool_name: str, *,
                 no_wait: bool = False) -> SessionHandle | None:
        """The handle a run of ``tool_name`` by ``owner`` gets for the session its call
        names (None when it names none: ``session_id`` empty).

        Args:
            owner: The caller's principal id.
            session_id: ``ExecuteRequest.session_id`` / ``StartRunRequest.session_id``.
            tool_name: The tool called: ``python`` and ``shell`` must match the kind.
            no_wait: The caller asked not to wait for a busy session.

        Raises:
            NotFound: Not one of the caller's open sessions (SESSION_NOT_FOUND).
            FailedPrecondition: ``python`` in a shell session or the reverse
                (SESSION_KIND_MISMATCH); busy while the caller would not wait (SESSION_BUSY).
        """
        if not session_id:
            return None
        session = self.get(owner, session_id)
        if tool_name in KINDS and tool_name != session.kind:
            raise FailedPrecondition(
                f"the session runs {session.kind}, not {tool_name}",
                reason=_KIND_MISMATCH, metadata={"session_kind": session.kind})
        if no_wait and session.busy:
            raise FailedPrecondition("the session is running another call", reason=_BUSY,
                                     metadata={"session_id": session.session_id})
        return SessionHandle.of(session, no_wait=no_wait)

    def owned_by(self, owner: str) -> list[Session]:
        """``owner``'s open sessions, oldest first."""
        return sorted((s for s in self._sessions.values()
                       if s.owner == owner and s.closed is None),
                      key=lambda s: s.created_at)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    async def close(self, owner: str, session_id: str) -> Session:
        """Closes one of ``owner``'s sessions.

        Raises:
            NotFound: Not one of theirs (SESSION_NOT_FOUND).
        """
        session = self.get(owner, session_id)
        await session.close(SessionClosed("the session was closed by its owner"))
        return session

    def holds(self, session_id: str) -> bool:
        """Whether this replica holds ``session_id`` (whoever owns it)."""
        return session_id in self._sessions

    def _forget(self, session: Session) -> None:
        self._sessions.pop(session.session_id, None)
        self._wake()
        if self.directory is not None:
            self._background(self.directory.release(session.session_id))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- time -------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the reaper that closes sessions past their TTL or idle time."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap(), name="session-reaper")

    def _wake(self) -> None:
        self._changed.set()

    async def _reap(self) -> None:
        while True:
            now = time.time()
            for session in list(self._sessions.values()):
                if session.deadline() <= now:
                    why = ("its time to live ended" if session.expires_at <= now
                           else "it was idle too long")
                    # Closed in the background: a slow close must not hold up the others.
                    self._background(session.close(SessionClosed(
                        f"the session was closed: {why}")))
                    self._sessions.pop(session.session_id, None)
            deadlines = [s.deadline() for s in self._sessions.values()]
            # A busy session's idle time starts when its call ends: look again then.
            wait = max(min(deadlines, default=now + 60.0) - time.time(), 0.05)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(wait, 60.0))

    async def aclose(self) -> None:
        """Closes every session (the server is stopping) and the reaper."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        closing = [s.close(SessionClosed("the server is shutting down"))
                   for s in list(self._sessions.values())]
        if closing:
            await asyncio.gather(*closing, return_exceptions=True)
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)
        if self.directory is not None:
            await self.directory.aclose()

