"""One session: a sandboxed kernel kept for its owner across calls.

A session is one long-running process of :meth:`stargrpc.sandbox.Sandbox.spawn` — the same
isolation, per-run user id and rlimits as a one-off sandboxed run, with the session's own
limits — running :mod:`stargrpc.sessions.kernel`. Its working directory is the session's
folder: files persist from call to call; a ``python`` session's interpreter keeps its
imports, variables and functions; a ``shell`` session runs each command with ``sh -c`` in
the folder (its background processes end with the command).

Calls run one at a time (:meth:`Session.turn`). A call sends one frame and reads the
kernel's frames until the ``done`` frame carrying the call's random id; output frames in
between stream to the caller. When the kernel dies (a limit killed it, it crashed, it
broke the protocol, its folder went over the disk cap) the call ends with
:class:`SessionLost` and the session is closed: its files go with it. (A clean restart with
the files kept would look like a live session to the caller but hold none of its state:
a loud end is the honest one.)

What each call used is measured by the server, not reported by the kernel: the CPU time of
the kernel's process tree before and after the call (:class:`~stargrpc.sandbox.runner.
TreeSampler`, from ``/proc``), its peak memory, and the folder's disk use after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog

from stargrpc.errors import ToolFailed
from stargrpc.sandbox import fsops
from stargrpc.sandbox.outfolder import OutputFile, SentFiles, read_out
from stargrpc.sandbox.rlimits import Limits
from stargrpc.sandbox.runner import (
    STEER_FILE_NAME,
    TICK_SECONDS,
    Sandbox,
    SandboxProcess,
    TreeSampler,
)
from stargrpc.sessions import protocol
from stargrpc.sessions.protocol import ProtocolError
from stargrpc.settings import MiB, Settings
from stargrpc.text import as_name

log = structlog.get_logger("stargrpc.sessions")

#: The kinds of session: the sandboxed tool each runs.
KINDS = ("python", "shell")
#: How long a kernel may take to say it is ready.
START_SECONDS = 30.0
#: Seconds between two samples of a session's process tree while a call runs.
SAMPLE_SECONDS = 0.5
#: After an interrupt, how long a call may take to end before the session is closed.
INTERRUPT_GRACE_SECONDS = 2.0

T = TypeVar("T")

#: Called with (channel, text) for each piece of a call's output.
OutputCallback = Callable[[str, str], Awaitable[None]]
#: Called every TICK_SECONDS of a call with the seconds it has run.
TickCallback = Callable[[float], Awaitable[None]]

_KERNEL_SOURCE = (Path(__file__).parent / "kernel.py").read_text(encoding="utf-8")


class SessionError(Exception):
    """A call could not run to its end in the session.

    Attributes:
        code: SESSION_LOST, SESSION_CLOSED or SESSION_BUSY.
        message: What happened, user-safe.
    """

    code = "SESSION_LOST"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SessionLost(SessionError):
    """The session's kernel died (or broke the protocol); the session is closed."""

    code = "SESSION_LOST"


class SessionClosed(SessionError):
    """The session was closed (owner, TTL, idle, shutdown) before or during the call."""

    code = "SESSION_CLOSED"


class SessionBusy(SessionError):
    """The session runs another call and the caller asked not to wait."""

    code = "SESSION_BUSY"


@dataclass(frozen=True)
class SessionLimits:
    """What a session was granted (each at most the server's ``session_*`` setting).

    Attributes:
        ttl_seconds: Longest life.
        idle_seconds: Longest time without a call.
        memory_mb: Address space of each of its processes.
        cpu_seconds: CPU seconds of each of its processes over its life.
        disk_mb: Disk its folder may hold.
    """

    ttl_seconds: float
    idle_seconds: float
    memory_mb: int
    cpu_seconds: int
    disk_mb: int

    def sandbox_limits(self, settings: Settings) -> Limits:
        """The sandbox limits of its kernel: these, and the server's for the rest."""
        return Limits(cpu_seconds=self.cpu_seconds, memory_bytes=self.memory_mb * MiB,
                      file_size_bytes=min(settings.sandbox_file_size_mb, self.disk_mb) * MiB,
                      max_processes=settings.sandbox_max_processes,
                      max_open_files=settings.sandbox_max_open_files,
                      wall_clock_seconds=settings.sandbox_wall_clock_seconds,
                      output_bytes=settings.sandbox_output_bytes,
                      sent_file_bytes=settings.sandbox_sent_file_bytes,
                      disk_bytes=self.disk_mb * MiB)


@dataclass
class SessionUsage:
    """Running totals over a session's calls.

    Attributes:
        wall_seconds: Wall time of its calls.
        cpu_user_seconds: User CPU of its process tree during its calls.
        cpu_system_seconds: System CPU, likewise.
        peak_rss_bytes: The largest peak resident memory of one of its processes.
        disk_bytes: Its folder's disk use after the last call.
    """

    wall_seconds: float = 0.0
    cpu_user_seconds: float = 0.0
    cpu_system_seconds: float = 0.0
    peak_rss_bytes: int | None = None
    disk_bytes: int | None = None


@dataclass
class CallEnd:
    """How a call in a session ended.

    Attributes:
        ok: The code ran to its end (python) or the command exited 0 (shell).
        error: The exception's last line, or how the command ended, when not ok.
        value: The final expression's value, when JSON (python); absent otherwise.
        has_value: Whether ``value`` is set.
        value_repr: Its repr (python), or "".
        exit_status: The command's exit status (shell).
        signal: The signal that killed the command (shell).
        timed_out: The call was interrupted at the wall clock.
        cpu_user_seconds: User CPU the session's tree used during the call (None: not
            measured).
        cpu_system_seconds: System CPU, likewise.
        peak_rss_bytes: The largest peak memory of a process of the session so far.
        disk_bytes: The folder's disk use after the call.
        duration: Wall-clock seconds of the call.
        output_truncated: Its output went past ``sandbox_output_bytes`` and was cut.
    """

    ok: bool
    error: str = ""
    value: Any = None
    has_value: bool = False
    value_repr: str = ""
    exit_status: int | None = None
    signal: int | None = None
    timed_out: bool = False
    cpu_user_seconds: float | None = None
    cpu_system_seconds: float | None = None
    peak_rss_bytes: int | None = None
    disk_bytes: int | None = None
    duration: float = 0.0
    output_truncated: bool = False


@dataclass
class _Call:
    """The call the kernel is running."""

    call_id: str
    on_output: OutputCallback | None
    left: int
    done: asyncio.Future[dict[str, Any]]
    truncated: bool = False

    async def output(self, channel: str, text: str) -> None:
        if self.truncated or self.on_output is None:
            return
        size = len(text.encode("utf-8", "replace"))
        if size > self.left:
            text = text.encode("utf-8", "replace")[:self.left].decode("utf-8", "ignore")
            self.truncated = True
            text += ("\n[output truncated: more than the call's output cap; the rest was "
                     "discarded]\n")
        self.left -= size
        try:
            await self.on_output(channel, text)
        except Exception:  # the run went away: keep reading the kernel regardless
            log.debug("session_output_dropped", exc_info=True)
            self.on_output = None


class Session:
    """A sandbox kept for one principal across calls.

    Attributes:
        session_id: Its id (unguessable; still only its owner may use it).
        kind: "python" or "shell".
        owner: The principal id of its creator.
        limits: What it was granted.
        created_at: Wall-clock time it was made (seconds since the epoch).
        last_used_at: Wall-clock time its last call ended (``created_at`` before one).
        calls: Calls run in it so far.
        usage: Running totals over its calls.
        closed: Why it was closed (a SessionError), once it is.
    """

    session_id: str
    kind: str
    owner: str
    limits: SessionLimits
    created_at: float
    last_used_at: float
    calls: int
    usage: SessionUsage
    closed: SessionError | None
    _process: SandboxProcess | None
    _sampler: TreeSampler | None
    _turn: asyncio.Lock
    _call: _Call | None
    _reader: asyncio.Task[None] | None
    _on_closed: Callable[[Session], None] | None
    _on_used: Callable[[], None] | None
    _workdir_inside: str
    _output_cap: int
    _wall_clock: float
    _sent_file_bytes: int

    def __init__(self, kind: str, owner: str, limits: SessionLimits, settings: Settings,
                 *, on_closed: Callable[[Session], None] | None = None,
                 on_used: Callable[[], None] | None = None) -> None:
        self.session_id = "ses_" + secrets.token_hex(16)
        self.kind = kind
        self.owner = owner
        self.limits = limits
        self.created_at = self.last_used_at = time.time()
        self.calls = 0
        self.usage = SessionUsage()
        self.closed = None
        self._process = None
        self._sampler = None
        self._turn = asyncio.Lock()
        self._call = None
        self._reader = None
        self._on_closed = on_closed
        self._on_used = on_used
        self._workdir_inside = ""
        self._output_cap = settings.sandbox_output_bytes
        self._wall_clock = settings.sandbox_wall_clock_seconds
        self._sent_file_bytes = settings.sandbox_sent_file_bytes

    # -- life -------------------------------------------------------------------------------

    async def start(self, sandbox: Sandbox, python: str) -> None:
        """Starts its kernel in ``sandbox`` and waits until it is ready.

        Raises:
            SessionLost: The kernel did not come up (the reason says why).
        """
        env = {"PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8",
               "STARGRPC_SESSION_ID": self.session_id,
               # With a PID namespace of its own, the kernel ends the processes each call
               # leaves behind; without one (rlimits) kill(-1) could reach others.
               "STARGRPC_SESSION_SWEEP": "1" if sandbox.isolation.mode != "rlimits" else "0"}
        self._process = await sandbox.spawn([python, "-I", "-u", "-c", _KERNEL_SOURCE],
                                            env=env, on_stderr=self._kernel_stderr)
        self._workdir_inside = sandbox.isolation.workdir_inside(self._process.folder)
        self._sampler = TreeSampler(self._process.pid)
        try:
            ready = await asyncio.wait_for(protocol.read_frame(self._process.stdout),
                                           START_SECONDS)
            if ready is None or ready.get("t") != "ready":
                if ready is None:  # it ended: wait for the exit, to say how
                    await asyncio.wait_for(asyncio.shield(self._process.exited), 5.0)
                raise SessionLost("the session's interpreter did not start: "
                                  + self._process.describe_exit())
        except (TimeoutError, ProtocolError) as exc:
            await self._process.aclose()
            raise SessionLost(f"the session's interpreter did not start: {exc}") from exc
        except BaseException:
            await self._process.aclose()
            raise
        self._reader = asyncio.create_task(self._read(), name=f"session-{self.session_id}")

    async def _kernel_stderr(self, channel: str, text: str) -> None:
        # The kernel's own stderr: only what Python says before the kernel redirected it,
        # or as it dies (a fatal error). The session's code writes elsewhere.
        log.info("session_kernel_stderr", session_id=self.session_id, text=text[-2000:])

    @property
    def folder(self) -> Path:
        """The session's folder on the server's host."""
        assert self._process is not None
        return self._process.folder

    @property
    def folder_inside(self) -> str:
        """The session's folder as its processes see it."""
        return self._workdir_inside

    @property
    def sent_file_bytes(self) -> int:
        """The byte cap of the files one call returns from its output folder."""
        return self._sent_file_bytes

    @property
    def busy(self) -> bool:
        """A call is running (or waiting to) in it."""
        return self._turn.locked()

    @property
    def expires_at(self) -> float:
        """When its TTL ends (seconds since the epoch)."""
        return self.created_at + self.limits.ttl_seconds

    def deadline(self) -> float:
        """When it is to be closed unless used again (its TTL or its idle time)."""
        if self.busy:
            return self.expires_at
        return min(self.expires_at, self.last_used_at + self.limits.idle_seconds)

    async def close(self, error: SessionError) -> None:
        """Closes it: a running call ends with ``error``; the kernel and its processes are
        killed and the folder removed. Safe to call more than once."""
        if self.closed is not None:
            return
        self.closed = error
        self._fail_call(error)
        if self._on_closed is not None:
            self._on_closed(self)
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        if self._process is not None:
            await self._process.aclose()
        log.info("session_closed", session_id=self.session_id, reason=error.message)

    def _fail_call(self, error: SessionError) -> None:
        call = self._call
        if call is not None and not call.done.done():
            call.done.set_exception(error)

    async def _read(self) -> None:
        """Reads the kernel's frames for as long as it lives; its end closes the session."""
        assert self._process is not None
        reason = ""
        try:
            while (frame := await protocol.read_frame(self._process.stdout)) is not None:
                await self._dispatch(frame)
        except ProtocolError as exc:
            reason = f"the session's interpreter broke the protocol ({exc})"
        except asyncio.CancelledError:
            return
        if not reason:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._process.exited), 5.0)
            reason = "the session's interpreter ended: " + self._process.describe_exit()
            cpu = self._sampler.cpu if self._sampler is not None else None
            if cpu is not None and sum(cpu) >= self.limits.cpu_seconds - SAMPLE_SECONDS:
                # Its own exit says little under unshare (the wrapper's status): the CPU
                # time its tree had used says which limit it met.
                reason += (f" (it had used its CPU time limit of {self.limits.cpu_seconds} s"
                           f": killed by it)")
        await self.close(SessionLost(reason + "; the session is closed"))

    async def _dispatch(self, frame: dict[str, Any]) -> None:
        call = self._call
        if call is None:
            return  # output of a background process between calls: nobody to tell
        kind = frame["t"]
        if kind == "out":
            channel, data = frame.get("ch"), frame.get("data")
            if channel in ("stdout", "stderr") and isinstance(data, str):
                await call.output(channel, data)
        elif kind == "done" and frame.get("call") == call.call_id and not call.done.done():
            call.done.set_result(frame)

    # -- calls ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def turn(self, *, wait: bool = True) -> AsyncIterator[None]:
        """Holds the session for one call (calls run one at a time).

        Raises:
            SessionBusy: ``wait`` is False and another call holds it.
            SessionClosed: It is closed (or closes while waiting).
        """
        if self.closed is not None:
            raise SessionClosed("the session is closed: " + self.closed.message)
        if not wait and self._turn.locked():
            raise SessionBusy("the session is running another call")
        async with self._turn:
            if self.closed is not None:
                raise SessionClosed("the session is closed: " + self.closed.message)
            try:
                yield
            finally:
                self.last_used_at = time.time()
                if self._on_used is not None:  # its idle time starts now
                    self._on_used()

    async def run(self, frame: dict[str, Any], *, on_output: OutputCallback | None = None,
                  on_tick: TickCallback | None = None,
                  wall_clock: float | None = None) -> CallEnd:
        """Runs one call (``frame``: ``{"t": "python", "code": …}`` or ``{"t": "shell",
        "command": …}``) in the kernel; call it inside :meth:`turn`.

        Raises:
            SessionLost: The kernel died during the call; the session is closed.
            SessionClosed: The session was closed during the call.
            asyncio.CancelledError: The run was stopped; the call was interrupted first
                (and the session closed when it would not stop).
        """
        process = self._process
        assert process is not None and self._sampler is not None
        if self.closed is not None:
            raise SessionClosed("the session is closed: " + self.closed.message)
        call = _Call(secrets.token_hex(16), on_output, self._output_cap,
                     asyncio.get_running_loop().create_future())
        # Its end may come (the session closed) when nobody waits for it any more.
        call.done.add_done_callback(_retrieved)
        self._sampler.sample()
        before = self._sampler.cpu
        started = time.monotonic()
        self._call = call
        timed_out = False
        try:
            try:
                process.stdin.write(protocol.encode({**frame, "call": call.call_id}))
                await process.stdin.drain()
            except (ConnectionError, OSError) as exc:
                await self.close(SessionLost(f"the session's interpreter is gone ({exc})"))
                raise self.closed or SessionLost("the session's interpreter is gone") from exc
            try:
                finished = await self._wait(call, started, wall_clock or self._wall_clock,
                                            on_tick)
                if finished is None:
                    timed_out = True
                    done = await self._interrupt(call)
                else:
                    done = finished
            except asyncio.CancelledError:
                # The run was stopped: interrupt the call (or close the session when it
                # will not stop), and still end as cancelled.
                with contextlib.suppress(SessionError):
                    await asyncio.shield(self._interrupt(call))
                raise
        finally:
            self._call = None
        self.calls += 1
        # Measured in a thread: a folder of many small files must not stall the loop.
        disk = await asyncio.to_thread(self._disk_used)
        if disk is not None and disk > self.limits.disk_mb * MiB:
            # Written faster than the folder's watch looks (a call that fills it and ends
            # at once): the call that went over the cap is the one that loses the session.
            await self.close(SessionLost(f"stopped: disk limit of {self.limits.disk_mb} MB "
                                         "exceeded; the session is closed"))
            raise self.closed or SessionLost("over its disk limit")
        return self._ended(done, call, started, before, timed_out, disk)

    async def _wait(self, call: _Call, started: float, wall_clock: float,
                    on_tick: TickCallback | None) -> dict[str, Any] | None:
        """The call's ``done`` frame, or None at the wall clock. Meanwhile the session's
        tree is sampled every :data:`SAMPLE_SECONDS` (what it used, and whether a limit
        killed it) and ``on_tick`` runs every :data:`TICK_SECONDS` (a silent call still
        shows it is alive)."""
        assert self._sampler is not None
        deadline = started + wall_clock
        next_tick = started + TICK_SECONDS
        while True:
            now = time.monotonic()
            if now >= deadline:
                return None
            try:
                return await asyncio.wait_for(asyncio.shield(call.done),
                                              min(deadline - now, SAMPLE_SECONDS))
            except TimeoutError:
                self._sampler.sample()
                now = time.monotonic()
                if on_tick is not None and next_tick <= now < deadline:
                    next_tick = now + TICK_SECONDS
                    await on_tick(now - started)

    async def _interrupt(self, call: _Call) -> dict[str, Any]:
        """Interrupts the running call; closes the session when it does not stop."""
        process = self._process
        assert process is not None
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            process.stdin.write(protocol.encode({"t": "interrupt", "call": call.call_id}))
            await process.stdin.drain()
        try:
            return await asyncio.wait_for(asyncio.shield(call.done), INTERRUPT_GRACE_SECONDS)
        except TimeoutError:
            await self.close(SessionLost("the session's interpreter did not stop when "
                                         "interrupted; the session is closed"))
            raise self.closed or SessionLost("lost") from None

    def _ended(self, done: dict[str, Any], call: _Call, started: float,
               before: tuple[float, float] | None, timed_out: bool,
               disk: int | None) -> CallEnd:
        assert self._sampler is not None
        self._sampler.sample()
        after = self._sampler.cpu
        end = CallEnd(ok=done.get("ok") is True, timed_out=timed_out,
                      duration=time.monotonic() - started, output_truncated=call.truncated)
        error = done.get("error")
        end.error = error[:2000] if isinstance(error, str) else ""
        if "value" in done:
            end.value, end.has_value = done["value"], True
        if isinstance(done.get("repr"), str):
            end.value_repr = done["repr"]
        for name in ("exit_status", "signal"):
            if isinstance(done.get(name), int):
                setattr(end, name, done[name])
        if before is not None and after is not None:
            end.cpu_user_seconds = max(after[0] - before[0], 0.0)
            end.cpu_system_seconds = max(after[1] - before[1], 0.0)
        end.peak_rss_bytes = self._sampler.peak_rss
        end.disk_bytes = disk
        totals = self.usage
        totals.wall_seconds += end.duration
        totals.cpu_user_seconds += end.cpu_user_seconds or 0.0
        totals.cpu_system_seconds += end.cpu_system_seconds or 0.0
        totals.peak_rss_bytes = end.peak_rss_bytes
        if end.disk_bytes is not None:
            totals.disk_bytes = end.disk_bytes
        return end

    def _disk_used(self) -> int | None:
        """The folder's disk use now (None when it could not be measured)."""
        assert self._process is not None
        fd, _ = self._process.open_folder()
        try:
            return fsops.measure(fd, self.limits.disk_mb * MiB).bytes
        except (fsops.Moved, OSError):
            return None
        finally:
            os.close(fd)

    def open_folder(self) -> tuple[int, fsops.Owner]:
        """A new descriptor of its folder (the caller closes it) and its owner."""
        assert self._process is not None
        return self._process.open_folder()

    def take_output(self, budget: int) -> tuple[list[OutputFile], list[str]]:
        """The files a call left in the session's output folder (``$OUTPUT_DIR``, ``out/``),
        read and removed from it (so the next call does not return them again): at most
        ``budget`` bytes, walked safely from the folder's descriptor
        (:func:`~stargrpc.sandbox.outfolder.read_out`).

        Returns:
            The files read, and why others were not (left in place).
        """
        folder_fd, owner = self.open_folder()
        sent = SentFiles()
        try:
            try:
                out_fd = fsops.open_dir(folder_fd, "out", owner)
            except OSError:
                return [], ["out: not a plain folder of the session"]
            try:
                read_out(out_fd, owner, sent, budget=budget, take=True)
            except (fsops.Moved, OSError):
                sent.skip("out: changed while it was read; the rest not returned")
            finally:
                os.close(out_fd)
        finally:
            os.close(folder_fd)
        return sent.files, sent.skipped

    def files(self, limit: int = 1000) -> list[tuple[str, int]]:
        """The regular files in its folder (relative name, size), at most ``limit`` (and
        at most ``20 * limit`` entries looked at), walked safely from the folder's
        descriptor (the session may have rearranged it); the server's steering file left
        out."""
        fd, owner = self.open_folder()
        found: list[tuple[str, int]] = []
        try:
            with fsops.walk(fd, max_depth=16) as tree:
                for seen, (name, _, info) in enumerate(tree.entries()):
                    if len(found) >= limit or seen >= 20 * limit:
                        break
                    if (owner.is_own(info) and stat.S_ISREG(info.st_mode)
                            and name != STEER_FILE_NAME):
                        # A name that is not UTF-8 is listed with its bytes escaped.
                        found.append((as_name(name), info.st_size))
        except (fsops.Moved, OSError):
            pass
        finally:
            os.close(fd)
        return found


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Marks a future's exception as seen (a call's end no one waits for any more)."""
    if not future.cancelled():
        future.exception()


def _plain(name: str) -> str:
    """``name`` when it is a plain file name (no folder, not . or ..)."""
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain file name")
    return name


@dataclass
class SessionHandle:
    """What a tool run in a session sees as ``ctx.session``.

    Attributes:
        session_id: The session.
        kind: "python" or "shell".
        folder: The session's folder on the server's host. The session's code owns it and
            may have put symlinks there: never open a path under it blindly (the server's
            process would follow them); use :meth:`read_file` and :meth:`write_file`.
        no_wait: The caller asked not to wait for a busy session.
    """

    session_id: str
    kind: str
    folder: Path
    session: Session = field(repr=False)
    no_wait: bool = False

    @classmethod
    def of(cls, session: Session, *, no_wait: bool = False) -> SessionHandle:
        """The handle of a run in ``session``."""
        return cls(session.session_id, session.kind, session.folder, session, no_wait)

    def write_file(self, name: str, data: bytes | str) -> None:
        """Writes a file of the session's folder (a plain name, no folders), owned by the
        session's user so that its code may change it; never through a symlink.

        Raises:
            ValueError: ``name`` is not a plain file name.
            OSError: It could not be written (such as a symlink or a folder of that name).
        """
        content = data.encode() if isinstance(data, str) else data
        folder_fd, owner = self.session.open_folder()
        try:
            fd = os.open(_plain(name), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK, 0o644, dir_fd=folder_fd)
            with os.fdopen(fd, "wb") as handle:
                info = os.fstat(handle.fileno())
                # Only a file of the session's own (or the one just made): never a hard
                # link the session made to a file of someone else's.
                if (not stat.S_ISREG(info.st_mode) or info.st_nlink != 1
                        or info.st_uid not in (owner.uid, os.geteuid())):
                    raise OSError(f"{name} is not a plain file of the session's")
                handle.truncate(0)
                handle.write(content)
                os.fchown(handle.fileno(), owner.uid, -1)
        finally:
            os.close(folder_fd)

    def read_file(self, name: str, limit: int = 8 * MiB) -> bytes:
        """Reads a regular file of the session's folder (a plain name), at most ``limit``
        bytes; never through a symlink.

        Raises:
            ValueError: ``name`` is not a plain file name, or the file is over ``limit``.
            OSError: No such regular file.
        """
        folder_fd, _ = self.session.open_folder()
        try:
            fd = os.open(_plain(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK, dir_fd=folder_fd)
            with os.fdopen(fd, "rb") as handle:
                info = os.fstat(handle.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise OSError(f"{name} is not a regular file")
                data = handle.read(limit + 1)
        finally:
            os.close(folder_fd)
        if len(data) > limit:
            raise ValueError(f"{name} is larger than {limit} bytes")
        return data

    async def hold(self, tool: Coroutine[Any, Any, T]) -> T:
        """Runs the tool's coroutine once the session's turn is its own (calls in one
        session run one at a time).

        Raises:
            ToolFailed: SESSION_BUSY (the caller would not wait), SESSION_CLOSED.
        """
        try:
            async with self.session.turn(wait=not self.no_wait):
                return await tool
        except SessionError as error:
            raise ToolFailed(error.message, code=error.code) from error
        finally:
            tool.close()  # never started when the turn was refused: no warning then
