"""The sandbox runner: one command, one fresh working directory, limits, and a clean end.

A run goes: make ``<sandbox_root>/run-<token>/`` (mode 0700, owned by the run's user: a
uid of its own from ``sandbox_uid_range`` when the server is root) with an ``out/`` folder
and the caller's input files; start ``prlimit … [isolation wrapper] argv``
in its own session with stdin closed and a scrubbed environment; stream stdout and stderr
line by line through a callback (cut with a marker past the output cap); wait for the exit
(through a pidfd, so the rusage of the whole tree comes back from ``wait4``) under a
wall clock and a disk cap (polled); kill the whole process group on timeout, disk cap or
cancellation; collect the files left in ``out/``; remove the working directory (a small
one, once nothing of its run is left, as the Result goes out).

What a run used (:class:`SandboxResult`'s CPU time, peak memory and bytes written, which
become its ``Result.usage``) is measured without cgroups: the server does not create them (it
runs without a delegated cgroup subtree in the common case: a container, a user service),
though they alone would see a whole tree at once, including the sum of its memory.

- CPU time: the larger of two measures. The rusage ``wait4`` returns for the command's
  leader covers it and every descendant reaped before it exited, by its own parent or by
  the PID-namespace init of ``unshare``. Bubblewrap's outer process exits as soon as its
  init reports the command's exit status, without reaping that init, so under ``bwrap``
  the rusage holds only bubblewrap's own; there the figure comes from sampling instead:
  every :data:`DISK_POLL_SECONDS` the server reads the CPU time (own and reaped children's)
  of each live process of the tree from ``/proc``. Missed: under ``bwrap``, what ran after
  the last sample; in every mode, processes still alive when the leader exited (the server
  kills them, uncounted), and with ``rlimits`` (no PID namespace) orphans, whom the host's
  init reaps.
- Peak memory: the largest ``VmHWM`` (peak resident set of a process's current program)
  among the samples, so a process that lived less than :data:`DISK_POLL_SECONDS` between
  two samples is missed, and it is the largest single process, not the tree's sum. The
  ``ru_maxrss`` of ``wait4`` cannot serve: the leader is spawned with ``vfork``, and its
  first ``execve`` records the server's own peak as the leader's.
- Bytes written: the disk use of the working directory at the end, as the disk cap
  measures it, less that of the input files. Missed: writes to bubblewrap's private
  ``/tmp`` (a tmpfs), files deleted before the end, data overwritten in place.

Steering reaches the command through ``$STEER_FILE``, ``.steer.jsonl`` in its working
directory: an append-only file, one JSON object ``{"message": …}`` per line, that the
server creates with the folder (empty) and appends each steering message to while the
command runs. The server writes it only through the descriptor it opened when it created
the file, so whatever the command does to the name (removes it, puts a symlink or a FIFO
there) it can only lose its own steering, never make the server write elsewhere.

The command owns its working directory and may have rearranged it (symlinks, FIFOs, hard
links, deep nesting): every later step on it goes through :mod:`stargrpc.sandbox.fsops`,
relative to the directory fd the server opened when it made the folder.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import json
import os
import pwd
import resource
import secrets
import select
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from stargrpc.sandbox import fsops
from stargrpc.sandbox.isolation import SANDBOX_PATH, Isolation, detect
from stargrpc.sandbox.outfolder import OutputFile, SentFiles, read_out
from stargrpc.sandbox.rlimits import Limits, Verdict, classify, disk_limit
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.sandbox")

#: Called with (channel, text) for each piece of output; channel is "stdout" or "stderr".
OutputCallback = Callable[[str, str], Awaitable[None]]
#: Called now and then with the seconds elapsed while the command runs silently or not.
TickCallback = Callable[[float], Awaitable[None]]
#: Called once with what the command's process tree used, however the command ended.
UsageCallback = Callable[["TreeUsage"], None]

#: The steering file in the working directory (``$STEER_FILE``).
STEER_FILE_NAME = ".steer.jsonl"

#: How much of each stream is kept to classify the end and to return as text.
TAIL_CHARS = 16 * 1024
#: Emit a line-less run of output once it is this long.
_PARTIAL_LINE_CHARS = 8 * 1024
#: After the command has exited, how long its pipes may stay open (held by a stray child).
_DRAIN_SECONDS = 2.0
#: How long the end of a run waits for the init of its PID namespace to exit.
_NAMESPACE_EXIT_SECONDS = 1.0
#: Seconds between ticks.
TICK_SECONDS = 5.0
#: Seconds between two measures of the working directory's disk use while a run runs.
DISK_POLL_SECONDS = 0.5
#: A folder left with at most this many entries in all (its own and below), once nothing
#: of its run is left to change it, is read and removed right on the event loop: a few
#: dozen system calls on a folder no process writes cost less than the hop to a thread
#: and back (two process switches, each a wait for a core on a busy machine). A larger
#: folder, or one whose run may have left a process, goes to a thread.
_INLINE_ENTRIES = 16
#: ... and whose files hold at most this many bytes in all (reading the output files and
#: removing the folder must stay a matter of microseconds on the loop).
_INLINE_BYTES = 256 * 1024
#: Such a small folder's removal waits this long in its thread after its run returned:
#: begun at once, the thread took the interpreter's lock turn about turn with the event
#: loop sending the run's last events and Result (1-2 ms later a Result, measured). Its
#: user id is released, and a warm pool refills, once it is done; :func:`removals` cuts
#: the wait short.
_REMOVAL_DELAY_SECONDS = 0.01


@dataclass(frozen=True)
class TreeUsage:
    """What a command's process tree used (see the module docstring for how each figure
    is measured and what it misses); None for a figure not measured."""

    cpu_user_seconds: float | None
    cpu_system_seconds: float | None
    peak_rss_bytes: int | None
    bytes_written: int | None


@dataclass
class SandboxResult:
    """How a sandboxed run ended.

    Attributes:
        verdict: Why it ended (``verdict.ok`` for exit status 0).
        exit_status: Exit status, when it exited.
        exit_signal: The signal that ended it, when one did.
        cpu_seconds: CPU time of the command and its reaped descendants, from ``wait4``
            (what the CPU limit is judged by; under bubblewrap only bubblewrap's own).
        cpu_user_seconds: User-mode CPU seconds of the tree, the larger of ``wait4``'s and
            the last sample's (None when neither measured it: a run under bubblewrap that
            ended before the first sample).
        cpu_system_seconds: Kernel-mode CPU seconds, as ``cpu_user_seconds``.
        peak_rss_bytes: The largest peak resident memory of a process of the tree seen
            by the samples (None before the first sample).
        bytes_written: The disk use of the working directory at the end less that of the
            input files (None when it could not be measured).
        (See the module docstring for what each measure misses.)
        duration: Wall-clock seconds.
        output_truncated: Output went past the cap and was cut.
        stdout_tail: The end of stdout.
        stderr_tail: The end of stderr.
        isolation: The isolation mode it ran in.
        files: Files left in the output folder, within the caps.
        skipped_files: Output files not returned, with why.
        stdout: All of stdout as it streamed (within the output cap, with the cut's
            marker when there was one): the DELTAs of channel ``stdout`` put together.
        stderr: The same for stderr.
    """

    verdict: Verdict
    exit_status: int | None
    exit_signal: int | None
    cpu_seconds: float
    duration: float
    output_truncated: bool
    stdout_tail: str
    stderr_tail: str
    isolation: str
    files: list[OutputFile] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    cpu_user_seconds: float | None = None
    cpu_system_seconds: float | None = None
    peak_rss_bytes: int | None = None
    bytes_written: int | None = None


@dataclass
class WarmStart:
    """A sandbox started ahead of its run (a warm pool's), handed to one run: its folder
    holds the run's input files, its command has been given and runs.

    Attributes:
        workdir: Its working directory.
        leader: Its leader.
        stdout: Its stdout, already connected (the hand-out was answered on it).
        stderr: Its stderr, already connected.
        ended: Done once the run is over: its processes gone, its output read and its
            folder removed (its Result gone out a moment before), however it ended.
    """

    workdir: _Workdir
    leader: _Leader
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    ended: asyncio.Future[None]


#: Makes a pooled sandbox's own state socket the run's (``StateSocket.adopt``): called
#: with the server's end and the sandbox's.
AdoptState = Callable[[socket.socket, socket.socket], None]
#: Gives a run a sandbox started ahead that fits it exactly, or None: called with the
#: sandbox, the command, its extra environment, its input files, the descriptors it
#: inherits, the host folders it is shown and how its state socket adopts a pooled
#: sandbox's (a source that cannot give it each of those exactly as a started sandbox
#: would have them gives None).
WarmSource = Callable[["Sandbox", list[str], Mapping[str, str], Mapping[str, str | bytes],
                       tuple[int, ...], tuple[Path, ...], AdoptState | None],
                      Awaitable[WarmStart | None]]
#: The warm pools of this process (:mod:`stargrpc.sandbox.pool` adds and removes them).
warm_sources: list[WarmSource] = []


async def _take_warm(sandbox: Sandbox, argv: list[str], env: Mapping[str, str],
                     files: Mapping[str, str | bytes], pass_fds: tuple[int, ...],
                     read_only_paths: tuple[Path, ...],
                     adopt_state: AdoptState | None) -> WarmStart | None:
    for source in list(warm_sources):
        warm = await source(sandbox, argv, env, files, pass_fds, read_only_paths,
                            adopt_state)
        if warm is not None:
            return warm
    return None


def sandbox_root(settings: Settings) -> Path:
    """The folder run working directories are made in (created 0711 if missing)."""
    root = settings.sandbox_root or Path(tempfile.gettempdir()) / "stargrpc-sandbox"
    root.mkdir(parents=True, exist_ok=True)
    info = root.lstat()
    # In a shared /tmp someone else could have made the folder (or a symlink) first.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise RuntimeError(f"sandbox root {root} is not a directory owned by the server's "
                           "user; remove it or set sandbox_root")
    # The sandbox user must be able to traverse it, but not list it (changed only when it
    # differs: this runs for every sandboxed call, and a chmod is a write to the disk's
    # journal even when it changes nothing).
    if stat.S_IMODE(info.st_mode) != 0o711:
        root.chmod(0o711)
    return root


def sandbox_ids(settings: Settings) -> tuple[int | None, int | None]:
    """The (uid, gid) to run as: the sandbox user when the server is root, else unchanged."""
    if os.geteuid() != 0:
        return None, None
    try:
        entry = pwd.getpwnam(settings.sandbox_user)
    except KeyError:
        return 65534, 65534
    return entry.pw_uid, entry.pw_gid


def run_ids(settings: Settings) -> tuple[int | None, int | None]:
    """The (uid, gid) a run gets, for checks made before any run (what it could read):
    with a root server and ``sandbox_uid_range`` set, an id of that range (each run has
    its own, none with a passwd entry or groups, so all are alike); otherwise
    :func:`sandbox_ids`."""
    uid, gid = sandbox_ids(settings)
    if uid is not None and settings.sandbox_uids is not None:
        first, _ = settings.sandbox_uids
        return first, first
    return uid, gid


#: Per-run uids taken by the runs of this process, released once a run's processes are gone.
_uids_in_use: set[int] = set()
#: Tries at finding a free uid in the range before giving up.
_UID_TRIES = 64


def _take_uid(first: int, last: int) -> int:
    """A uid of the range that no run of this process holds and no process runs as."""
    for _ in range(_UID_TRIES):
        uid = first + secrets.randbelow(last - first + 1)
        if uid not in _uids_in_use and not _live_processes(uid=uid):
            _uids_in_use.add(uid)
            return uid
    raise RuntimeError("no free user id left in sandbox_uid_range")


def isolation_for(settings: Settings) -> Isolation:
    """The isolation mode the settings ask for, probed on this machine (cached).

    Raises:
        RuntimeError: A mode was asked for explicitly and does not work here.
    """
    uid, gid = sandbox_ids(settings)
    return detect(settings.sandbox_isolation, sandbox_root(settings), uid, gid)


class _Output:
    """The output budget shared by stdout and stderr, the tails kept of each and, for a
    run (``keep``), all of each as it streamed: bounded by the same budget."""

    def __init__(self, cap: int, on_output: OutputCallback | None, *, keep: bool = False
                 ) -> None:
        self.left = cap
        self.cap = cap
        self.truncated = False
        self.on_output = on_output
        self.tails: dict[str, str] = {"stdout": "", "stderr": ""}
        self.kept: dict[str, list[str]] | None = {"stdout": [], "stderr": []} if keep else None

    def text(self, channel: str) -> str:
        """All of ``channel`` as it streamed ("" when not kept)."""
        return "".join(self.kept[channel]) if self.kept is not None else ""

    async def emit(self, channel: str, text: str) -> None:
        if text and self.kept is not None:
            self.kept[channel].append(text)
        if text and self.on_output is not None:
            try:
                await self.on_output(channel, text)
            except Exception:
                # Stop forwarding but keep draining: a pipe nobody reads would block the
                # command until the wall clock.
                log.exception("sandbox_output_callback_failed")
                self.on_output = None

    async def pump(self, reader: asyncio.StreamReader, channel: str) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        tail_decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        while chunk := await reader.read(65536):
            self.tails[channel] = (self.tails[channel]
                                   + tail_decoder.decode(chunk[-TAIL_CHARS:]))[-TAIL_CHARS:]
            if self.truncated:
                continue  # keep draining so the command never blocks on a full pipe
            allowed = min(len(chunk), self.left)
            self.left -= allowed
            pending += decoder.decode(chunk[:allowed])
            if allowed < len(chunk):
                self.truncated = True
                await self.emit(channel, pending)
                pending = ""
                await self.emit(channel, f"\n[output truncated: more than {self.cap} bytes; "
                                         "the rest was discarded]\n")
                continue
            cut = pending.rfind("\n")
            if cut >= 0:
                await self.emit(channel, pending[:cut + 1])
                pending = pending[cut + 1:]
            elif len(pending) >= _PARTIAL_LINE_CHARS:
                await self.emit(channel, pending)
                pending = ""
        if not self.truncated:
            await self.emit(channel, pending + decoder.decode(b"", final=True))


class WorkdirUnavailable(OSError):
    """A run's working directory could not be made under ``sandbox_root``, or its input
    files not written (the file system is full, say): the run never started. It keeps the
    errno (ENOSPC, EDQUOT, …) but not the path, and is an OSError, as it was before it had
    a name of its own."""


def setup_failed_message(exc: OSError, what: str = "the run's folder") -> str:
    """What the caller is told when ``what`` under ``sandbox_root`` could not be set up: a
    full disk (or quota) by name, since it passes once space is freed; the OS's words
    otherwise (never the server's path)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the sandbox is unavailable: no space left on the server's sandbox disk "
                f"({what} could not be set up); try again once space is freed")
    said = exc.strerror or type(exc).__name__
    return f"the sandbox is unavailable: {what} could not be set up ({said})"


class Sandbox:
    """Runs commands under the configured isolation and limits.

    Attributes:
        limits: The limits of each run.
        isolation: The isolation mode in use.
    """

    limits: Limits
    isolation: Isolation
    _root: Path
    _uid: int | None
    _gid: int | None
    _uid_range: tuple[int, int] | None
    _keep: bool
    _env_allowlist: list[str]

    def __init__(self, settings: Settings, limits: Limits | None = None) -> None:
        self.limits = limits or Limits.from_settings(settings)
        # As isolation_for does, with the root and ids looked up once (a call each run).
        self._root = sandbox_root(settings)
        self._uid, self._gid = sandbox_ids(settings)
        self.isolation = detect(settings.sandbox_isolation, self._root, self._uid, self._gid)
        self._uid_range = settings.sandbox_uids if self._uid is not None else None
        self._keep = settings.sandbox_keep_workdir
        self._env_allowlist = list(settings.sandbox_env_allowlist)

    @property
    def root(self) -> Path:
        """The folder its runs' working directories are made in (:func:`sandbox_root`)."""
        return self._root

    async def run(self, argv: list[str], *, files: Mapping[str, str | bytes] | None = None,
                  env: Mapping[str, str] | None = None,
                  on_output: OutputCallback | None = None,
                  on_tick: TickCallback | None = None,
                  steering: AsyncIterator[str] | None = None,
                  on_usage: UsageCallback | None = None,
                  pass_fds: Sequence[int] = (),
                  read_only_paths: Sequence[Path] = (),
                  adopt_state: AdoptState | None = None) -> SandboxResult:
        """Runs ``argv`` in a fresh working directory and waits for it.

        Args:
            argv: The command; looked up on the sandbox PATH.
            files: Input files written into the working directory first (relative names).
            env: Extra environment variables for this command.
            on_output: Receives the output as it is produced.
            on_tick: Called every few seconds while the command runs.
            steering: Messages to append to ``$STEER_FILE`` while the command runs.
            on_usage: Told once what the command's tree used — also when the run is
                cancelled, which returns no result (bytes written are then not measured).
            pass_fds: Descriptors the command inherits (the run's state socket).
            read_only_paths: Host folders shown read-only inside bubblewrap.
            adopt_state: With ``pass_fds`` the run's state socket, its ``adopt``: how a
                sandbox of the warm pool, started with a state socket of its own, has
                that socket served as the run's (without it the run starts its own).

        Returns:
            How it ended, once every process of the run is gone and ``out/`` is read.
            Limits hit are a verdict, not an exception. The working directory is removed
            before this returns, or, when it is small and nothing of the run is left, a
            moment after, in a thread (:func:`removals` awaits those).

        Raises:
            asyncio.CancelledError: The run was cancelled; the process group is killed
                before this propagates.
            WorkdirUnavailable: Its working directory could not be set up (a full disk,
                say); nothing was started.
        """
        files = files or {}
        env = env or {}
        check_input_names(files)
        # A pre-started sandbox of the warm pool when one fits this run exactly, else one
        # started now: the same folder, user, limits and isolation either way.
        # A pooled sandbox shows the folders it was started with, and holds at most a
        # state socket, which the run's adopts: a run that needs another folder or
        # descriptor starts its own (the pool decides, see
        # stargrpc.sandbox.warm.WarmKind.match).
        warm = await _take_warm(self, argv, env, files, tuple(pass_fds),
                                tuple(read_only_paths), adopt_state)
        workdir = warm.workdir if warm is not None else self._make_workdir(files)
        try:
            started = time.monotonic()
            pump = (asyncio.create_task(_pump_steering(steering, workdir.steer_fd))
                    if steering is not None else None)
            try:
                if warm is not None:
                    return await self._run_in(workdir, warm.leader, (warm.stdout, warm.stderr),
                                              on_output, on_tick, started, on_usage, pump)
                leader = _Leader(self._command(argv, workdir, read_only_paths), workdir,
                                 self._environment(workdir.path, env), stdin=subprocess.DEVNULL,
                                 pass_fds=pass_fds)
                return await self._run_in(workdir, leader, None, on_output, on_tick,
                                          started, on_usage, pump)
            finally:
                await _stop_steering(pump)
        finally:
            # In a thread that owns the folder's fds: a huge tree must not stall the event
            # loop, and a second cancellation must not close them under it. A run that
            # ended normally began it already, with the reading of out/ (one thread hop).
            if workdir.finishing is None:
                workdir.finishing = asyncio.ensure_future(
                    asyncio.to_thread(_finish, workdir, self._keep))
            if warm is not None:
                workdir.finishing.add_done_callback(lambda _: _set_done(warm.ended))
            if not workdir.in_background:
                await asyncio.shield(workdir.finishing)

    async def spawn(self, argv: list[str], *, env: Mapping[str, str] | None = None,
                    read_only_paths: Sequence[Path] = (),
                    on_stderr: OutputCallback | None = None) -> SandboxProcess:
        """Starts ``argv`` as a long-running process with stdin and stdout pipes (a stdio
        server), under the same isolation, limits and per-run user as :meth:`run`; there is
        no wall clock, and the disk cap is polled while it lives.

        Args:
            argv: The command; looked up on the sandbox PATH.
            env: Extra environment variables.
            read_only_paths: Host folders shown read-only inside bubblewrap.
            on_stderr: Receives its stderr (within the output cap).

        Returns:
            The running process; :meth:`SandboxProcess.aclose` kills its process group and
            removes its working directory.
        """
        workdir = self._make_workdir({})
        try:
            leader = _Leader(self._command(argv, workdir, read_only_paths), workdir,
                             self._environment(workdir.path, env or {}),
                             stdin=subprocess.PIPE)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(_finish, workdir, self._keep))
            raise
        process = SandboxProcess(leader, workdir, self._keep, self.limits,
                                 wrapped=self.isolation.mode != "rlimits")
        try:
            await process._connect(_Output(self.limits.output_bytes, on_stderr))
        except BaseException:
            # Cancelled or failed while its pipes were connected: nobody else will close it.
            await process.aclose()
            raise
        return process

    def _command(self, argv: list[str], workdir: _Workdir,
                 read_only_paths: Sequence[Path] = ()) -> list[str]:
        """``argv`` under the limits and the isolation wrapper, as the run's user."""
        return self.isolation.command(argv, workdir.path, limits=self.limits.prlimit_argv(),
                                      uid=workdir.uid, gid=workdir.gid,
                                      tmpfs_bytes=self.limits.disk_bytes,
                                      read_only_paths=read_only_paths)

    async def _run_in(self, workdir: _Workdir, leader: _Leader,
                      connected: tuple[asyncio.StreamReader, asyncio.StreamReader] | None,
                      on_output: OutputCallback | None, on_tick: TickCallback | None,
                      started: float, on_usage: UsageCallback | None,
                      steering: asyncio.Task[None] | None = None) -> SandboxResult:
        """Streams, supervises and ends the started ``leader`` (``connected``: its stdout
        and stderr already connected, for a warm sandbox); once it has ended,
        stops ``steering`` (which writes into the folder) and reads ``out/`` and removes
        the folder: in one thread, or right here when nothing of the run is left and the
        folder holds at most :data:`_INLINE_ENTRIES` entries."""
        output = _Output(self.limits.output_bytes, on_output, keep=True)
        sampler = _TreeSampler(leader.proc.pid)
        pumps: list[asyncio.Task[None]] = []
        stopped: Verdict | None = None
        try:
            # Inside the try: connecting a pipe takes loop turns, and a cancellation landing
            # there must still bring the group down before the folder and uid are given back.
            if connected is not None:
                pumps += [asyncio.create_task(output.pump(connected[0], "stdout")),
                          asyncio.create_task(output.pump(connected[1], "stderr"))]
            else:
                for pipe, channel in ((leader.proc.stdout, "stdout"),
                                      (leader.proc.stderr, "stderr")):
                    reader = await leader.read_pipe(pipe)
                    pumps.append(asyncio.create_task(output.pump(reader, channel)))
            stopped = await self._wait(leader.exited, started, on_tick, workdir, sampler)
        except BaseException:
            # Cancellation or an error: the whole group goes down, and what it used up to
            # then is still told (a run stopped for hogging the CPU is the one to count).
            _, usage = await leader.end(workdir, pumps, drain=True)
            if on_usage is not None:
                on_usage(TreeUsage(*self._tree_usage(usage, sampler), bytes_written=None))
            raise
        # The exit, the wall clock or the disk cap: the whole group goes down.
        status, usage = await leader.end(workdir, pumps, drain=True)
        await _stop_steering(steering)  # its last write lands before the folder's fds close
        if leader.tree_gone and _few_entries(workdir.fd):
            # Nothing of the run is left to change the folder: out/ is read here, and the
            # folder removed in a thread while the Result goes out (:meth:`run` does not
            # wait for it: the rmdirs were a good part of the end of a short run).
            final = self._collect(os.dup(workdir.fd), workdir.owner)
            workdir.finishing = _Removal(workdir, self._keep).done
            workdir.in_background = True
        else:
            workdir.finishing = asyncio.ensure_future(
                asyncio.to_thread(self._collect_and_finish, workdir))
            final = await asyncio.shield(workdir.finishing)
        result = self._result(status, usage, sampler, stopped, output, started, final,
                              workdir.input_bytes)
        if on_usage is not None:
            on_usage(TreeUsage(result.cpu_user_seconds, result.cpu_system_seconds,
                               result.peak_rss_bytes, result.bytes_written))
        return result

    async def _wait(self, exited: asyncio.Future[None], started: float,
                    on_tick: TickCallback | None, workdir: _Workdir,
                    sampler: _TreeSampler) -> Verdict | None:
        """Waits for the exit; returns the verdict when the run must be stopped first."""
        deadline = started + self.limits.wall_clock_seconds
        next_tick = started + TICK_SECONDS
        while not exited.done():
            now = time.monotonic()
            if now >= deadline:
                return Verdict("WALL_CLOCK_LIMIT", "killed: wall-clock limit of "
                               f"{self.limits.wall_clock_seconds:g} s exceeded")
            await asyncio.wait([exited], timeout=min(deadline, next_tick,
                                                      now + DISK_POLL_SECONDS) - now)
            if exited.done():
                break
            sampler.sample()
            if await _over_disk_cap(workdir, self.limits.disk_bytes):
                return disk_limit(self.limits)
            now = time.monotonic()
            if now >= next_tick and now < deadline:
                next_tick = now + TICK_SECONDS
                if on_tick is not None:
                    await on_tick(now - started)
        return None

    def _result(self, status: int, usage: resource.struct_rusage, sampler: _TreeSampler,
                stopped: Verdict | None, output: _Output, started: float, final: _Final,
                input_bytes: int) -> SandboxResult:
        cpu = usage.ru_utime + usage.ru_stime
        cpu_user, cpu_system, peak = self._tree_usage(usage, sampler)
        exit_signal, exit_status = _decode_status(status, self.isolation.mode != "rlimits")
        verdict = stopped or classify(
            self.limits, exit_signal=exit_signal, exit_status=exit_status, cpu_seconds=cpu,
            largest_file=final.usage.largest_file, stderr_tail=output.tails["stderr"],
            disk_used=final.usage.bytes)
        return SandboxResult(
            verdict=verdict, exit_status=exit_status, exit_signal=exit_signal,
            cpu_seconds=cpu, duration=time.monotonic() - started,
            output_truncated=output.truncated, stdout_tail=output.tails["stdout"],
            stderr_tail=output.tails["stderr"], isolation=self.isolation.mode,
            files=final.files, skipped_files=final.skipped, stdout=output.text("stdout"),
            stderr=output.text("stderr"),
            cpu_user_seconds=cpu_user, cpu_system_seconds=cpu_system, peak_rss_bytes=peak,
            bytes_written=(max(final.usage.bytes - input_bytes, 0) if final.measured
                           else None))

    def _tree_usage(self, usage: resource.struct_rusage, sampler: _TreeSampler
                    ) -> tuple[float | None, float | None, int | None]:
        """(user CPU, system CPU, peak memory) of the tree: the CPU time of ``wait4``'s
        rusage or of the last sample, whichever is larger (the rusage is bubblewrap's
        alone under ``bwrap``: see the module docstring), and the samples' peak."""
        cpu_user: float | None = usage.ru_utime
        cpu_system: float | None = usage.ru_stime
        if self.isolation.mode == "bwrap":
            cpu_user = cpu_system = None
        if sampler.cpu is not None and (cpu_user is None or cpu_system is None
                                        or sum(sampler.cpu) > cpu_user + cpu_system):
            cpu_user, cpu_system = sampler.cpu
        return cpu_user, cpu_system, sampler.peak_rss

    def start_key(self) -> tuple[object, ...]:
        """Everything a started sandbox depends on before it is given a command: two
        sandboxes with the same key are started alike (isolation, root, user ids, limits,
        the environment the server passes on), so one started ahead for one may serve
        the other."""
        return (self.isolation.mode, self._root, self._uid, self._gid, self._uid_range,
                self._keep, self.limits,
                tuple((name, os.environ.get(name)) for name in self._env_allowlist))

    def _make_workdir(self, files: Mapping[str, str | bytes]) -> _Workdir:
        """A fresh working directory for one run, with ``files`` written into it.

        Raises:
            WorkdirUnavailable: The folder could not be made or filled (a full disk, say).
        """
        check_input_names(files)
        try:
            return self._new_workdir(files)
        except OSError as exc:
            raise WorkdirUnavailable(exc.errno, exc.strerror) from exc

    def _new_workdir(self, files: Mapping[str, str | bytes]) -> _Workdir:
        uid, gid = self._uid, self._gid
        own_uid = self._uid_range is not None
        if self._uid_range is not None:
            uid = gid = _take_uid(*self._uid_range)
        name = f"run-{secrets.token_hex(8)}"
        try:
            root_fd = os.open(self._root, fsops.DIR_FLAGS)
            try:
                os.mkdir(name, 0o700, dir_fd=root_fd)
                fd = fsops.open_dir(root_fd, name)
            except BaseException:
                os.close(root_fd)
                raise
        except BaseException:
            if own_uid:
                _uids_in_use.discard(uid)
            raise
        workdir = _Workdir(self._root / name, name, root_fd, fd,
                           fsops.Owner(os.geteuid() if uid is None else uid,
                                       os.fstat(fd).st_dev), uid, gid, own_uid, -1)
        try:
            _prepare(workdir)
            write_inputs(workdir, files, self.limits)
        except BaseException:
            _finish(workdir, keep=False)
            raise
        return workdir

    def _environment(self, workdir: Path, extra: Mapping[str, str]) -> dict[str, str]:
        inside = self.isolation.workdir_inside(workdir)
        env = {name: os.environ[name] for name in self._env_allowlist if name in os.environ}
        tmp = "/tmp" if self.isolation.mode == "bwrap" else str(workdir / "tmp")
        env.update({"PATH": SANDBOX_PATH, "HOME": inside, "TMPDIR": tmp,
                    "OUTPUT_DIR": f"{inside}/out", "STEER_FILE": f"{inside}/{STEER_FILE_NAME}"})
        env.setdefault("LANG", "C.UTF-8")
        env.update(extra)
        return env

    def _collect_and_finish(self, workdir: _Workdir) -> _Final:
        """:meth:`_collect`, then :func:`_finish` (in a thread)."""
        try:
            return self._collect(os.dup(workdir.fd), workdir.owner)
        finally:
            _finish(workdir, self._keep)

    def _collect(self, run_fd: int, owner: fsops.Owner) -> _Final:
        """Measures the working directory and reads ``out/`` (in a thread; closes
        ``run_fd``, a duplicate of the folder's fd)."""
        final = _Final()
        try:
            with contextlib.suppress(fsops.Moved, OSError):
                final.usage = fsops.measure(run_fd, self.limits.disk_bytes, unlock=True)
                final.measured = True
            try:
                out_fd = fsops.open_dir(run_fd, "out", owner)
            except OSError:
                final.skip("out: not a plain folder of the run; no file returned")
                return final
            try:
                read_out(out_fd, owner, final, budget=self.limits.sent_file_bytes)
            except (fsops.Moved, OSError):
                final.skip("out: changed while it was read; the rest not returned")
            finally:
                os.close(out_fd)
        finally:
            os.close(run_fd)
        return final


class SandboxProcess:
    """A long-running sandboxed process (see :meth:`Sandbox.spawn`).

    Attributes:
        pid: The process id (and process group id) of the command's leader.
        stdin: Writes to its standard input.
        stdout: Reads its standard output.
        exited: Done once the leader has exited, or the process was stopped.
        stopped: Why the server stopped it (a limit), when it did.
    """

    pid: int
    stdin: asyncio.StreamWriter
    stdout: asyncio.StreamReader
    exited: asyncio.Future[None]
    stopped: Verdict | None
    _leader: _Leader
    _workdir: _Workdir
    _keep: bool
    _limits: Limits
    _tasks: list[asyncio.Task[None]]
    _closed: bool
    _wrapped: bool

    def __init__(self, leader: _Leader, workdir: _Workdir, keep: bool, limits: Limits, *,
                 wrapped: bool) -> None:
        self.pid = leader.proc.pid
        self.exited = leader.exited
        self._wrapped = wrapped
        self.stopped = None
        self._leader = leader
        self._workdir = workdir
        self._keep = keep
        self._limits = limits
        self._tasks = []
        self._closed = False

    async def _connect(self, stderr: _Output) -> None:
        proc = self._leader.proc
        assert proc.stdout and proc.stdin and proc.stderr
        self.stdout = await self._leader.read_pipe(proc.stdout, limit=16 * 1024 * 1024)
        errors = await self._leader.read_pipe(proc.stderr)
        self.stdin = await self._leader.write_pipe(proc.stdin)
        self._tasks = [asyncio.create_task(stderr.pump(errors, "stderr")),
                       asyncio.create_task(self._watch_disk())]

    async def _watch_disk(self) -> None:
        while not self.exited.done():
            await asyncio.wait([self.exited], timeout=DISK_POLL_SECONDS * 4)
            if await _over_disk_cap(self._workdir, self._limits.disk_bytes):
                self.stopped = disk_limit(self._limits)
                _kill_group(self.pid)
                return

    @property
    def folder(self) -> Path:
        """Its working directory on the host (held open by the server: see
        :meth:`open_folder`)."""
        return self._workdir.path

    def open_folder(self) -> tuple[int, fsops.Owner]:
        """A new descriptor of its working directory (the caller closes it) and what each
        entry of it must match, for walking it safely with :mod:`stargrpc.sandbox.fsops`."""
        return os.dup(self._workdir.fd), self._workdir.owner

    def describe_exit(self) -> str:
        """How the leader ended, once :attr:`exited` is done (it stays unreaped, holding
        its process group, until :meth:`aclose`)."""
        if self.stopped is not None:
            return f"it was stopped: {self.stopped.message}"
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
        if info is None:
            return "it exited"
        if info.si_code == os.CLD_EXITED:
            signal_number, status = _decode_status(info.si_status << 8,
                                                   self._wrapped)
        else:
            signal_number, status = info.si_status, None
        if signal_number is not None:
            return f"it was killed by signal {signal.Signals(signal_number).name}"
        return f"it exited with status {status}"

    async def aclose(self) -> int | None:
        """Kills the process group (if still running), reaps it and removes its working
        directory; safe to call more than once.

        Returns:
            The wait status of the leader, or None when it was already closed.
        """
        if self._closed:
            return None
        self._closed = True
        with contextlib.suppress(Exception):
            self.stdin.close()
        status, _ = await self._leader.end(self._workdir, self._tasks, drain=False)
        await asyncio.shield(asyncio.to_thread(_finish, self._workdir, self._keep))
        return status


class _Leader:
    """A started command's leader, in a session (and process group) of its own, watched
    through a pidfd: :attr:`exited` is done once it exits; it stays unreaped, holding its
    process group, until :meth:`end`.

    Attributes:
        proc: The leader (its pipes: stdout and stderr, and stdin when asked for).
        exited: Done once the leader has exited.
    """

    proc: subprocess.Popen[bytes]
    exited: asyncio.Future[None]
    #: A pidfd of the init of its PID namespace, when the starter found it (-1: unknown).
    namespace_init: int
    #: Set by :meth:`end`: none of the run's processes is left (its PID namespace's init
    #: exited, or a pass over /proc found nothing of its group and its own uid).
    tree_gone: bool
    _pidfd: int
    _loose: list[IO[bytes]]

    def __init__(self, command: list[str], workdir: _Workdir, env: Mapping[str, str], *,
                 stdin: int, pass_fds: Sequence[int] = ()) -> None:
        # Popen, not asyncio's subprocess: the exit must be reaped here with wait4 (for the
        # CPU time of the tree); Popen only spawns (vfork+exec), so it returns at once.
        self.proc = subprocess.Popen(
            command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=workdir.path, env=env, start_new_session=True, close_fds=True,
            pass_fds=tuple(pass_fds))
        #: Its pipes not (yet) handed to a transport, closed by :meth:`end`.
        self._loose = [pipe for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr)
                       if pipe is not None]
        self._pidfd = -1
        self.namespace_init = -1
        self.tree_gone = False
        try:
            loop = asyncio.get_running_loop()
            self._pidfd = os.pidfd_open(self.proc.pid)
            self.exited = loop.create_future()
            loop.add_reader(self._pidfd, _set_done, self.exited)
        except BaseException:
            # No caller holds the leader yet: it would run on, unwatched and unreaped.
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Kills the group, reaps the leader and closes what was opened (the leader never
        got watched; a killed process exits at once, so the blocking reap is short)."""
        _kill_group(self.proc.pid)
        with contextlib.suppress(ChildProcessError):
            _reap(self.proc)
        if self._pidfd >= 0:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
        self._close_loose()

    def _close_loose(self) -> None:
        for pipe in self._loose:
            with contextlib.suppress(OSError):
                pipe.close()
        self._loose = []

    async def read_pipe(self, pipe: IO[bytes] | None, limit: int = 64 * 1024, *,
                        reader: asyncio.StreamReader | None = None) -> asyncio.StreamReader:
        """A stream reader on one of its pipes (its transport owns the pipe from then on):
        ``reader`` when given, else a new one of ``limit`` bytes."""
        reader = await _read_pipe(pipe, limit, reader)
        self._loose.remove(pipe)  # type: ignore[arg-type]
        return reader

    async def write_pipe(self, pipe: IO[bytes] | None) -> asyncio.StreamWriter:
        """A stream writer on its stdin (its transport owns the pipe from then on)."""
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), pipe)
        self._loose.remove(pipe)  # type: ignore[arg-type]
        return asyncio.StreamWriter(transport, protocol, None, loop)

    async def end(self, workdir: _Workdir, tasks: Sequence[asyncio.Task[None]], *,
                  drain: bool) -> tuple[int, resource.struct_rusage]:
        """Kills the process group (at once when the leader still runs), reaps the leader,
        lets ``tasks`` (that read its pipes) finish for a moment (``drain``) or cancels
        them, and kills what is left of the run's processes. Pipes never handed to a reader
        (the start was cancelled first) are closed.

        Returns:
            The leader's wait status and the rusage of its tree.
        """
        pid = self.proc.pid
        if not self.exited.done():
            _kill_group(pid)
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self.exited), 5.0)
        # The leader is a zombie (its pgid still reserved): kill strays, then reap.
        _kill_group(pid)
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        status, usage = _reap(self.proc)
        self._close_loose()
        if not drain:
            for task in tasks:
                task.cancel()
        if tasks:
            _, still_open = await asyncio.wait(tasks, timeout=_DRAIN_SECONDS)
            for task in still_open:
                task.cancel()
        if await self._namespace_gone():
            self.tree_gone = True
        else:
            own_uid = workdir.uid if workdir.own_uid else None
            # Without a uid of its own, a process that left the group would go unseen.
            self.tree_gone = await _wait_group_gone(pid, own_uid) and own_uid is not None
        return status, usage

    async def _namespace_gone(self) -> bool:
        """Whether the init of the run's PID namespace, when known, has exited (within
        :data:`_NAMESPACE_EXIT_SECONDS`): the kernel ends every other process of the
        namespace before the exit of its init is told, and no process can leave a PID
        namespace, so none of the run's processes is left (the pass over /proc that
        :func:`_wait_group_gone` makes is then not needed). Closes its pidfd."""
        fd, self.namespace_init = self.namespace_init, -1
        if fd < 0:
            return False
        try:
            if _readable_now(fd):
                return True
            exited = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(fd, _set_done, exited)
            try:
                await asyncio.wait([exited], timeout=_NAMESPACE_EXIT_SECONDS)
            finally:
                asyncio.get_running_loop().remove_reader(fd)
            return exited.done()
        finally:
            os.close(fd)


@dataclass
class _Workdir:
    """A run's working directory, held open by the server.

    Attributes:
        path: Its path (for the command's cwd and the isolation wrapper only).
        name: Its name in the sandbox root.
        root_fd: The sandbox root.
        fd: The folder itself, opened when it was made.
        owner: What every entry in it must match.
        uid: The run's user (None: the server's own).
        gid: The run's group.
        own_uid: The uid was taken for this run alone.
        steer_fd: The steering file, open for appending (-1 until made).
        input_bytes: The disk use of the folder once the server filled it, before the run.
        finishing: Reading its output and removing it (in a thread), once under way.
        in_background: ``finishing`` only removes it, and the run does not wait for it.
    """

    path: Path
    name: str
    root_fd: int
    fd: int
    owner: fsops.Owner
    uid: int | None
    gid: int | None
    own_uid: bool
    steer_fd: int
    input_bytes: int = 0
    finishing: asyncio.Future[Any] | None = None
    in_background: bool = False


@dataclass
class _Final(SentFiles):
    """What is found in the working directory once the run is over."""

    usage: fsops.Usage = field(default_factory=lambda: fsops.Usage(0, 0))
    measured: bool = False


def check_input_names(files: Mapping[str, str | bytes]) -> None:
    """Raises ValueError unless every input file name is a plain file name."""
    for name in files:
        if not name or name.startswith(".") or Path(name).name != name or name in (
                "out", "tmp"):
            raise ValueError(f"input file name {name!r} must be a plain file name")


def _prepare(workdir: _Workdir) -> None:
    """Makes ``out/``, ``tmp/`` and the steering file, owned by the run's user (what every
    run finds in its folder, whatever its inputs)."""
    uid, gid = workdir.uid, workdir.gid
    for sub in ("out", "tmp"):
        os.mkdir(sub, 0o700, dir_fd=workdir.fd)
        if uid is not None and gid is not None:
            os.chown(sub, uid, gid, dir_fd=workdir.fd, follow_symlinks=False)
    workdir.steer_fd = os.open(STEER_FILE_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                               | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                               dir_fd=workdir.fd)
    if uid is not None and gid is not None:
        os.fchown(workdir.steer_fd, uid, gid)
        os.fchown(workdir.fd, uid, gid)


def write_inputs(workdir: _Workdir, files: Mapping[str, str | bytes], limits: Limits) -> None:
    """Writes the input files (owned by the run's user) and notes the folder's disk use
    then, so that the run's bytes written leave them out."""
    uid, gid = workdir.uid, workdir.gid
    for name, content in files.items():
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600, dir_fd=workdir.fd)
        with os.fdopen(fd, "wb") as handle:
            handle.write(content.encode() if isinstance(content, str) else content)
            if uid is not None and gid is not None:
                os.fchown(handle.fileno(), uid, gid)
    workdir.input_bytes = fsops.measure(workdir.fd, limits.disk_bytes).bytes


def _finish(workdir: _Workdir, keep: bool) -> None:
    """Removes the working directory (unless kept), closes its fds and frees the run's
    uid (its processes are gone by now)."""
    try:
        if keep:
            log.info("sandbox_workdir_kept", workdir=str(workdir.path))
        elif not fsops.remove_tree(workdir.root_fd, workdir.name):
            log.error("sandbox_workdir_not_removed", workdir=str(workdir.path))
    finally:
        if workdir.steer_fd >= 0:
            os.close(workdir.steer_fd)
        os.close(workdir.fd)
        os.close(workdir.root_fd)
        if workdir.own_uid and workdir.uid is not None:
            _uids_in_use.discard(workdir.uid)


async def _stop_steering(pump: asyncio.Task[None] | None) -> None:
    """Stops appending steering messages (idempotent)."""
    if pump is not None:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump


async def _pump_steering(steering: AsyncIterator[str], steer_fd: int) -> None:
    """Appends each steering message to the steering file, one JSON line each."""
    async for message in steering:
        line = json.dumps({"message": message}, ensure_ascii=False).encode() + b"\n"
        try:
            # A regular file the server created and holds: the write does not block.
            os.write(steer_fd, line)
        except OSError as exc:  # the run filled its disk, say: it only loses its steering
            log.warning("steer_file_write_failed", error=str(exc))


async def _over_disk_cap(workdir: _Workdir, cap: int) -> bool:
    """Whether the working directory uses more than ``cap`` bytes of disk now (measured in a
    thread; False when it could not be measured this time)."""
    return await asyncio.to_thread(_disk_used_over, os.dup(workdir.fd), cap)


def _disk_used_over(run_fd: int, cap: int) -> bool:
    """:func:`_over_disk_cap` in the thread; closes ``run_fd``, a duplicate."""
    try:
        return fsops.measure(run_fd, cap).bytes > cap
    except (fsops.Moved, OSError):
        return False
    finally:
        os.close(run_fd)


async def _read_pipe(pipe: IO[bytes] | None, limit: int = 64 * 1024,
                     reader: asyncio.StreamReader | None = None) -> asyncio.StreamReader:
    """A stream reader on one of the leader's pipes (``reader``, or a new one)."""
    if reader is None:
        reader = asyncio.StreamReader(limit=limit)
    feeding = reader
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(feeding), pipe)
    return reader


class _Removal:
    """The removal of a small folder whose run has returned, in a thread of the loop's
    executor that waits :data:`_REMOVAL_DELAY_SECONDS` first (or less: :meth:`begin`);
    ``done`` is done once the folder is gone. Waiting in the thread rather than on a loop
    timer, the removal is never left behind: ``asyncio.run`` waits for the executor's
    threads before it returns."""

    def __init__(self, workdir: _Workdir, keep: bool) -> None:
        self._now = threading.Event()
        loop = asyncio.get_running_loop()
        if any(done.get_loop() is loop for done in _removing):
            # A burst: removals waiting out their delay would each hold one of the few
            # executor threads every to_thread call of the server shares. The delay is for
            # the lone call whose last events the loop is sending; one waiting is enough.
            self._now.set()
        self.done: asyncio.Future[None] = asyncio.ensure_future(
            asyncio.to_thread(self._remove, workdir, keep))
        # One whose loop was closed first never completes here (its thread did finish).
        for other in [done for done in _removing if done.get_loop().is_closed()]:
            del _removing[other]
        _removing[self.done] = self
        self.done.add_done_callback(_removed)

    def _remove(self, workdir: _Workdir, keep: bool) -> None:
        self._now.wait(_REMOVAL_DELAY_SECONDS)
        _finish(workdir, keep)

    def begin(self) -> None:
        """Removes the folder now, without waiting out the delay."""
        self._now.set()


#: The removals of folders that runs of this process have not waited for, by their
#: ``done`` future (see :func:`removals`).
_removing: dict[asyncio.Future[Any], _Removal] = {}


def _removed(removal: asyncio.Future[Any]) -> None:
    _removing.pop(removal, None)
    if not removal.cancelled() and removal.exception() is not None:
        log.error("sandbox_workdir_removal_failed", error=str(removal.exception()))


async def removals() -> None:
    """Returns once the folders of the runs of this event loop that have returned are
    removed (a run whose processes are all gone and whose folder is small returns once its
    ``out/`` is read, and its folder is removed a moment after, in a thread): those still
    waiting out their delay are removed now."""
    loop = asyncio.get_running_loop()
    while pending := [done for done in _removing if done.get_loop() is loop]:
        for done in pending:
            _removing[done].begin()
        await asyncio.wait(pending)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _wait_group_gone(pgid: int, uid: int | None) -> bool:
    """Kills what is left of the process group (and, with a uid of the run's own, every
    process of that uid: one that left the group too) until nothing but zombies waiting
    for init is; bounded, so a process that escaped cannot stall us. Returns whether
    nothing was left in the end."""
    deadline = time.monotonic() + _DRAIN_SECONDS
    while time.monotonic() < deadline:
        left = _live_processes(pgid=pgid, uid=uid)
        if not left:
            return True
        _kill_group(pgid)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.05)
    return False


def _few_entries(dir_fd: int) -> bool:
    """Whether the folder ``dir_fd`` holds at most :data:`_INLINE_ENTRIES` entries and
    :data:`_INLINE_BYTES` bytes of files in all (False when it cannot be listed)."""
    try:
        return _entries_within(dir_fd, _INLINE_ENTRIES, [_INLINE_BYTES]) >= 0
    except OSError:
        return False


def _entries_within(dir_fd: int, budget: int, bytes_left: list[int] | None = None) -> int:
    """What is left of ``budget`` once the entries below ``dir_fd`` are counted (reading at
    most one more than it: negative when there are more, or a folder cannot be opened).
    With ``bytes_left`` (one number, spent as regular files are met), negative too once
    their sizes pass it. Never through a symlink; ``stat`` only for regular files."""
    with os.scandir(dir_fd) as listing:
        for entry in listing:
            budget -= 1
            if budget < 0:
                return budget
            if bytes_left is not None and entry.is_file(follow_symlinks=False):
                bytes_left[0] -= entry.stat(follow_symlinks=False).st_size
                if bytes_left[0] < 0:
                    return -1
            elif entry.is_dir(follow_symlinks=False):
                try:
                    below = fsops.open_dir(dir_fd, entry.name)
                except OSError:
                    return -1
                try:
                    budget = _entries_within(below, budget, bytes_left)
                finally:
                    os.close(below)
                if budget < 0:
                    return budget
    return budget


def _live_processes(*, pgid: int | None = None, uid: int | None = None) -> list[int]:
    """Live (non-zombie) processes of the process group ``pgid`` or whose real, effective
    or saved uid is ``uid``: one pass over /proc. With a group asked for, each process's
    ``stat`` is read (state and process group, as this /proc sees them) and, when a uid is
    asked for too and the group did not match, its ``status`` (the ids); with a uid alone,
    only its ``status`` (which says the state too). Each file read with one system call
    and parsed by search, not split into fields: this pass runs at every sandbox's start
    (for its uid) and at the end of runs, over every process of the machine, and reading
    /proc is slow on a VM (about 25 us a process through file objects here)."""
    wanted_uid = None if uid is None else str(uid).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        if pgid is not None:
            try:
                # After the ")" of the command name: state, ppid, pgrp, …
                state, _, group, _ = _read_proc(f"/proc/{name}/stat").rsplit(
                    b")", 1)[1].split(None, 3)
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if state in (b"Z", b"X"):
                continue
            if int(group) == pgid:
                found.append(int(name))
                continue
        if wanted_uid is None:
            continue
        try:
            status = _read_proc(f"/proc/{name}/status")
        except OSError:
            continue  # gone meanwhile
        if pgid is None and _status_line(status, b"State")[:1] in (b"Z", b"X"):
            continue
        if wanted_uid in _status_line(status, b"Uid").split()[:3]:
            found.append(int(name))
    return found


def _readable_now(target: int | IO[bytes] | socket.socket) -> bool:
    """Whether ``target`` (a descriptor, a file or a socket) can be read now without
    waiting: data, its end, or an exited process's pidfd. ``poll``, not ``select``, which
    refuses descriptors numbered 1024 and above (a server holding many connections)."""
    poller = select.poll()
    poller.register(target, select.POLLIN)
    return bool(poller.poll(0))


def _read_proc(path: str) -> bytes:
    """A small file of /proc, read with one system call (no file object: the passes over
    /proc read one or two a process).

    Raises:
        OSError: It cannot be read (the process is gone, say).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 16384)
    finally:
        os.close(fd)


def _status_line(status: bytes, name: bytes) -> bytes:
    """The value of the line ``name:`` of a /proc status file, stripped (b"" if absent)."""
    at = status.find(b"\n" + name + b":")
    if at < 0:
        return b""
    at += len(name) + 2
    end = status.find(b"\n", at)
    return status[at:end if end >= 0 else len(status)].strip()


#: Processes of one tree a sample reads at most (the process limit keeps trees smaller).
_MAX_SAMPLED = 512
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class _TreeSampler:
    """Samples the live processes of a command's tree in ``/proc``: their CPU time (own
    and reaped children's) and peak resident memory (see the module docstring).

    Attributes:
        cpu: (user, system) CPU seconds of the tree at the last sample that found it, or
            None before one did.
        peak_rss: The largest ``VmHWM`` seen, in bytes, or None before a sample found one.
    """

    cpu: tuple[float, float] | None
    peak_rss: int | None
    _root: int

    def __init__(self, root: int) -> None:
        self._root = root
        self.cpu = None
        self.peak_rss = None

    def sample(self) -> None:
        """Reads the tree once (a few small files per process; never raises)."""
        user = system = 0
        found = False
        pending: list[int] = [self._root]
        seen: set[int] = set()
        while pending and len(seen) < _MAX_SAMPLED:
            pid = pending.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    stat_line = handle.read()
                with open(f"/proc/{pid}/status", "rb") as handle:
                    status = handle.read()
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue  # gone meanwhile
            # After the ")" of the command name: state, ppid, …; utime, stime, cutime and
            # cstime are the 12th to 15th fields from there.
            fields = stat_line.rsplit(b")", 1)[1].split()
            user += int(fields[11]) + int(fields[13])
            system += int(fields[12]) + int(fields[14])
            found = True
            for line in status.splitlines():
                if line.startswith(b"VmHWM:"):  # absent for a zombie or a kernel thread
                    peak = int(line.split()[1]) * 1024
                    self.peak_rss = max(self.peak_rss or 0, peak)
                    break
            for task in tasks:
                try:
                    with open(f"/proc/{pid}/task/{task}/children", "rb") as handle:
                        pending.extend(int(child) for child in handle.read().split())
                except OSError:
                    continue
        if found:
            self.cpu = (user / _CLOCK_TICKS, system / _CLOCK_TICKS)


def _reap(proc: subprocess.Popen[bytes]) -> tuple[int, resource.struct_rusage]:
    """Reaps the exited leader; returns its wait status and the rusage of its tree (its
    own and that of every descendant reaped before it: see the module docstring)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits itself
    return status, usage


def _decode_status(status: int, wrapped: bool) -> tuple[int | None, int | None]:
    """(signal, exit status) of a wait status. A wrapper (bwrap, unshare) reports a
    command killed by signal N as exit status 128+N."""
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status), None
    code = os.WEXITSTATUS(status)
    if wrapped and 128 < code < 128 + 65:
        return code - 128, None
    return None, code


#: The sampler of a process tree's CPU time and peak memory, for the long-running
#: processes of :meth:`Sandbox.spawn` (a session measures each of its calls with it).
TreeSampler = _TreeSampler
