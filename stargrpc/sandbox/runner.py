"""The sandbox runner: one command, one fresh working directory, limits, and a clean end.

A run goes: make ``<sandbox_root>/run-<token>/`` (owned by the sandbox user) with an
``out/`` folder and the caller's input files; start ``prlimit … [isolation wrapper] argv``
in its own session with stdin closed and a scrubbed environment; stream stdout and stderr
line by line through a callback (cut with a marker past the output cap); wait for the exit
(through a pidfd, so the CPU time of the whole tree comes back from ``wait4``) under a
wall clock; kill the whole process group on timeout or cancellation; collect the files
left in ``out/``; remove the working directory.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import mimetypes
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from stargrpc.sandbox.isolation import SANDBOX_PATH, Isolation, detect
from stargrpc.sandbox.limits import Limits, Verdict, classify
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.sandbox")

#: Called with (channel, text) for each piece of output; channel is "stdout" or "stderr".
OutputCallback = Callable[[str, str], Awaitable[None]]
#: Called now and then with the seconds elapsed while the command runs silently or not.
TickCallback = Callable[[float], Awaitable[None]]

#: How much of each stream is kept to classify the end and to return as text.
TAIL_CHARS = 16 * 1024
#: Emit a line-less run of output once it is this long.
_PARTIAL_LINE_CHARS = 8 * 1024
#: Output-folder files returned at most.
MAX_SENT_FILES = 32
#: After the command has exited, how long its pipes may stay open (held by a stray child).
_DRAIN_SECONDS = 2.0
#: Seconds between ticks.
TICK_SECONDS = 5.0
#: Most directory entries looked at when measuring the working directory.
_MAX_WALK = 10_000


@dataclass(frozen=True)
class OutputFile:
    """A file the command left in its output folder."""

    name: str
    data: bytes
    mime_type: str


@dataclass
class SandboxResult:
    """How a sandboxed run ended.

    Attributes:
        verdict: Why it ended (``verdict.ok`` for exit status 0).
        exit_status: Exit status, when it exited.
        exit_signal: The signal that ended it, when one did.
        cpu_seconds: CPU time of the command and its reaped descendants.
        duration: Wall-clock seconds.
        output_truncated: Output went past the cap and was cut.
        stdout_tail: The end of stdout.
        stderr_tail: The end of stderr.
        files: Files left in the output folder, within the caps.
        skipped_files: Output files not returned, with why.
        isolation: The isolation mode it ran in.
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


def sandbox_root(settings: Settings) -> Path:
    """The folder run working directories are made in (created 0711 if missing)."""
    root = settings.sandbox_root or Path(tempfile.gettempdir()) / "stargrpc-sandbox"
    root.mkdir(parents=True, exist_ok=True)
    info = root.lstat()
    # In a shared /tmp someone else could have made the folder (or a symlink) first.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise RuntimeError(f"sandbox root {root} is not a directory owned by the server's "
                           "user; remove it or set sandbox_root")
    # The sandbox user must be able to traverse it, but not list it.
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


def isolation_for(settings: Settings) -> Isolation:
    """The isolation mode the settings ask for, probed on this machine (cached).

    Raises:
        RuntimeError: A mode was asked for explicitly and does not work here.
    """
    uid, gid = sandbox_ids(settings)
    return detect(settings.sandbox_isolation, sandbox_root(settings), uid, gid)


class _Output:
    """The output budget shared by stdout and stderr, and the tails kept of each."""

    def __init__(self, cap: int, on_output: OutputCallback | None) -> None:
        self.left = cap
        self.cap = cap
        self.truncated = False
        self.on_output = on_output
        self.tails: dict[str, str] = {"stdout": "", "stderr": ""}

    async def emit(self, channel: str, text: str) -> None:
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
    _keep: bool
    _env_allowlist: list[str]

    def __init__(self, settings: Settings, limits: Limits | None = None) -> None:
        self.limits = limits or Limits.from_settings(settings)
        self.isolation = isolation_for(settings)
        self._root = sandbox_root(settings)
        self._uid, self._gid = sandbox_ids(settings)
        self._keep = settings.sandbox_keep_workdir
        self._env_allowlist = list(settings.sandbox_env_allowlist)

    async def run(self, argv: list[str], *, files: Mapping[str, str | bytes] | None = None,
                  env: Mapping[str, str] | None = None,
                  on_output: OutputCallback | None = None,
                  on_tick: TickCallback | None = None) -> SandboxResult:
        """Runs ``argv`` in a fresh working directory and waits for it.

        Args:
            argv: The command; looked up on the sandbox PATH.
            files: Input files written into the working directory first (relative names).
            env: Extra environment variables for this command.
            on_output: Receives the output as it is produced.
            on_tick: Called every few seconds while the command runs.

        Returns:
            How it ended. Limits hit are a verdict, not an exception.

        Raises:
            asyncio.CancelledError: The run was cancelled; the process group is killed
                before this propagates.
        """
        workdir = self._make_workdir(files or {})
        inside = self.isolation.workdir_inside(workdir)
        full_env = self._environment(inside, workdir, env or {})
        started = time.monotonic()
        try:
            return await self._run_in(workdir, argv, full_env, on_output, on_tick, started)
        finally:
            if self._keep:
                log.info("sandbox_workdir_kept", workdir=str(workdir))
            else:
                shutil.rmtree(workdir, ignore_errors=True)

    async def _run_in(self, workdir: Path, argv: list[str], env: dict[str, str],
                      on_output: OutputCallback | None, on_tick: TickCallback | None,
                      started: float) -> SandboxResult:
        command = self.isolation.command(argv, workdir, limits=self.limits.prlimit_argv(),
                                         uid=self._uid, gid=self._gid)
        # Popen, not asyncio's subprocess: the exit must be reaped here with wait4 (for the
        # CPU time of the tree); Popen only spawns (vfork+exec), so it returns at once.
        proc = subprocess.Popen(  # noqa: ASYNC220
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=workdir, env=env, start_new_session=True,
            close_fds=True)
        loop = asyncio.get_running_loop()
        output = _Output(self.limits.output_bytes, on_output)
        pumps = []
        for pipe, channel in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            reader = asyncio.StreamReader()
            protocol = asyncio.StreamReaderProtocol(reader)
            await loop.connect_read_pipe(lambda p=protocol: p, pipe)  # type: ignore[misc]
            pumps.append(asyncio.create_task(output.pump(reader, channel)))
        pidfd = os.pidfd_open(proc.pid)
        exited: asyncio.Future[None] = loop.create_future()
        loop.add_reader(pidfd, _set_done, exited)
        timed_out = False
        try:
            timed_out = await self._wait(exited, started, on_tick)
        finally:
            if not exited.done():
                # Wall clock, cancellation or an error: take the whole group down now.
                _kill_group(proc.pid)
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(exited), 5.0)
            # The leader is a zombie (its pgid still reserved): kill strays, then reap.
            _kill_group(proc.pid)
            loop.remove_reader(pidfd)
            os.close(pidfd)
            status, cpu = _reap(proc)
            _, still_open = await asyncio.wait(pumps, timeout=_DRAIN_SECONDS)
            for pump in still_open:
                pump.cancel()
            await _wait_group_gone(proc.pid)
        return self._result(workdir, proc, status, cpu, timed_out, output, started)

    async def _wait(self, exited: asyncio.Future[None], started: float,
                    on_tick: TickCallback | None) -> bool:
        deadline = started + self.limits.wall_clock_seconds
        while not exited.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            await asyncio.wait([exited], timeout=min(left, TICK_SECONDS))
            if not exited.done() and on_tick is not None and time.monotonic() < deadline:
                await on_tick(time.monotonic() - started)
        return False

    def _result(self, workdir: Path, proc: subprocess.Popen[bytes], status: int,
                cpu: float, timed_out: bool, output: _Output,
                started: float) -> SandboxResult:
        exit_signal, exit_status = _decode_status(status, self.isolation.mode != "rlimits")
        if timed_out:
            verdict = Verdict("WALL_CLOCK_LIMIT", "killed: wall-clock limit of "
                              f"{self.limits.wall_clock_seconds:g} s exceeded")
        else:
            verdict = classify(self.limits, exit_signal=exit_signal, exit_status=exit_status,
                               cpu_seconds=cpu, largest_file=_largest_file(workdir),
                               stderr_tail=output.tails["stderr"])
        result = SandboxResult(
            verdict=verdict, exit_status=exit_status, exit_signal=exit_signal,
            cpu_seconds=cpu, duration=time.monotonic() - started,
            output_truncated=output.truncated, stdout_tail=output.tails["stdout"],
            stderr_tail=output.tails["stderr"], isolation=self.isolation.mode)
        self._collect(workdir / "out", result)
        return result

    def _make_workdir(self, files: Mapping[str, str | bytes]) -> Path:
        for name in files:
            if not name or name.startswith(".") or Path(name).name != name or name in (
                    "out", "tmp"):
                raise ValueError(f"input file name {name!r} must be a plain file name")
        workdir = self._root / f"run-{secrets.token_hex(8)}"
        workdir.mkdir(mode=0o700)
        made = [workdir, workdir / "out", workdir / "tmp"]
        for path in made[1:]:
            path.mkdir(mode=0o700)
        for name, content in files.items():
            target = workdir / name
            target.write_bytes(content.encode() if isinstance(content, str) else content)
            made.append(target)
        if self._uid is not None and self._gid is not None:
            for path in made:
                os.chown(path, self._uid, self._gid)
        return workdir

    def _environment(self, inside: str, workdir: Path, extra: Mapping[str, str]
                     ) -> dict[str, str]:
        env = {name: os.environ[name] for name in self._env_allowlist if name in os.environ}
        tmp = "/tmp" if self.isolation.mode == "bwrap" else str(workdir / "tmp")
        env.update({"PATH": SANDBOX_PATH, "HOME": inside, "TMPDIR": tmp,
                    "OUTPUT_DIR": f"{inside}/out"})
        env.setdefault("LANG", "C.UTF-8")
        env.update(extra)
        return env

    def _collect(self, out: Path, result: SandboxResult) -> None:
        budget = self.limits.sent_file_bytes
        for path in sorted(_regular_files(out)):
            name = str(path.relative_to(out))
            if len(result.files) >= MAX_SENT_FILES:
                result.skipped_files.append(f"{name}: more than {MAX_SENT_FILES} files")
                continue
            data = _read_own_file(path, self._uid, budget)
            if data is None:
                result.skipped_files.append(
                    f"{name}: over the {self.limits.sent_file_bytes} byte cap of sent files"
                    if path.lstat().st_size > budget else f"{name}: not a plain file")
                continue
            budget -= len(data)
            mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
            result.files.append(OutputFile(name, data, mime))


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _wait_group_gone(pgid: int) -> None:
    """Kills what is left of the process group until nothing (but zombies waiting for
    init) is; bounded, so a process that escaped into its own session cannot stall us."""
    deadline = time.monotonic() + _DRAIN_SECONDS
    while _group_members(pgid) and time.monotonic() < deadline:
        _kill_group(pgid)
        await asyncio.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # After the ")" of the command name: state, ppid, pgrp, …
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry.name))
    return members


def _reap(proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    """Reaps the exited leader; returns its wait status and the CPU time of its tree."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits itself
    return status, usage.ru_utime + usage.ru_stime


def _decode_status(status: int, wrapped: bool) -> tuple[int | None, int | None]:
    """(signal, exit status) of a wait status. A wrapper (bwrap, unshare) reports a
    command killed by signal N as exit status 128+N."""
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status), None
    code = os.WEXITSTATUS(status)
    if wrapped and 128 < code < 128 + 65:
        return code - 128, None
    return None, code


def _regular_files(folder: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, _, names in os.walk(folder, followlinks=False):
        found.extend(Path(dirpath) / name for name in names)
        if len(found) > _MAX_WALK:
            break
    return found


def _largest_file(workdir: Path) -> int:
    largest = 0
    for path in _regular_files(workdir):
        with contextlib.suppress(OSError):
            largest = max(largest, path.lstat().st_size)
    return largest


def _read_own_file(path: Path, uid: int | None, budget: int) -> bytes | None:
    """The content of a regular file the sandbox made, or None. Symlinks, hard links to
    files of others, devices and FIFOs are refused: the server reads with its own rights."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or (
                uid is not None and info.st_uid != uid) or info.st_size > budget:
            return None
        return handle.read(budget + 1)[:budget]
