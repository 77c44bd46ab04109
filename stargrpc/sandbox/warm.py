"""Sandboxes started ahead of their run: the launcher that waits in one, and its hand-out.

A warm sandbox is started exactly as a run's sandbox is (:meth:`Sandbox._make_workdir`: a
fresh folder and a user id of its own; :meth:`Sandbox._command`: the same ``setpriv``,
``prlimit`` and isolation wrapper), only its command is a *launcher* that says ``ready``
and waits on its stdin (a pipe) for the one command it will run. It serves exactly one run
and is then destroyed like any run's sandbox.

What is fixed when it starts, and must therefore match the run exactly (else the run starts
a sandbox of its own): the isolation, the sandbox root, the user ids, the limits, the
environment (the server's allowlisted variables and the run's extra ones: a
:class:`WarmKind` serves one extra environment only), and the interpreter for ``python``.
What is given at hand-out: the input files (written by the server through the folder's fd,
as for any run) and the command's arguments.

The hand-out, over the sandbox's own pipes (one line each)::

    launcher -> server   ready                 (once started)
    server -> launcher   <nonce>               (128 random bits, hex), then <count>, then
                         <count> lines: the arguments, with "\\" written "\\\\" and a
                         newline "\\n"; then the pipe is closed (one write)
    launcher -> server   fresh <nonce>
    launcher             stdin becomes /dev/null; runs the command (``exec``, or the
                         Python snippet in the interpreter already started)

The server writes the run's input files first, and starts streaming the command's output
only once the answer is right; a sandbox that answers wrongly or not within
:data:`HANDSHAKE_SECONDS` is destroyed with whatever it began, and the run starts its own.

Before anything is written, :meth:`WarmSandbox.unfit` checks that nothing touched it while it
waited: its leader alive (through its pidfd), its process tree the same processes (pid and
start time), none stopped or traced, with the same user ids; nothing on its stderr; its
folder the same inode at the same name with the same entries, each unchanged (inode, size,
mode, owner, links, mtime, ctime; ``out/`` and ``tmp/`` empty, so anything added below them
changes them too). A sandbox that fails a check, or does not answer the nonce, is destroyed
and never given to a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import select
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from stargrpc.sandbox.rlimits import Limits
from stargrpc.sandbox.runner import (
    Sandbox,
    WarmStart,
    _finish,
    _Leader,
    _Workdir,
    write_inputs,
)
from stargrpc.settings import Settings

#: The flags the python tool runs its interpreter with (no user site-packages, unbuffered;
#: not -I: the scrubbed environment is read, for its PYTHONPATH holds the state client).
PYTHON_FLAGS = ("-s", "-u")
#: The extra environment of the python tool's command.
PYTHON_ENV: Mapping[str, str] = {"PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"}

#: Seconds a warm sandbox may take to say ``ready`` (a busy machine starts slowly).
START_SECONDS = 30.0
#: Seconds a warm sandbox may take to answer the hand-out's nonce before it is given up.
HANDSHAKE_SECONDS = 5.0

#: The launcher of commands run with ``exec`` (the shell tool's ``sh -c …`` and any other
#: command with no extra environment), in POSIX sh: its builtins only, so that what it
#: costs the run before ``exec`` (CPU time counts against the run's limit) is a few
#: microseconds. ``read -r`` takes a line as it is; ``printf %b`` undoes the escapes (only
#: "\\\\" and "\\n" occur), and the "x" keeps the trailing newlines that "$(…)" would drop.
SH_LAUNCHER = r"""printf 'ready\n'
IFS= read -r nonce || exit 0
printf 'fresh %s\n' "$nonce"
IFS= read -r count || exit 0
set --
while [ "$count" -gt 0 ]; do
  IFS= read -r arg || exit 0
  case $arg in *\\*) arg=$(printf '%bx' "$arg"); arg=${arg%x} ;; esac
  set -- "$@" "$arg"
  count=$((count - 1))
done
exec "$@" </dev/null
"""

#: The launcher of the python tool: the interpreter started with the tool's flags and
#: environment, then given the script's arguments and running it as ``__main__`` as
#: ``python3 -I -u SCRIPT`` would (``__file__`` absolute, ``sys.argv`` the arguments, no
#: launcher frame in a traceback, exit status 1 on an uncaught exception and 2 when the
#: script cannot be opened). What differs: ``sys.orig_argv`` and ``/proc/self/cmdline``
#: show the launcher, a frame of it sits under the script's on the stack, and a source the
#: compiler refuses before parsing (a NUL byte) is reported without its line.
PY_LAUNCHER = r"""import os, sys
def _take():
    os.write(1, b"ready\n")
    pending = b""
    def line():
        nonlocal pending
        while b"\n" not in pending:
            chunk = os.read(0, 65536)
            if not chunk:
                os._exit(0)
            pending += chunk
        head, _, pending = pending.partition(b"\n")
        return head
    nonce = line()
    os.write(1, b"fresh " + nonce + b"\n")
    args = [os.fsdecode(b"\\".join(part.replace(b"\\n", b"\n")
                                   for part in line().split(b"\\\\")))
            for _ in range(int(line()))]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return args
def _run(args):
    path = os.path.abspath(args[0])
    try:
        with open(path, "rb") as handle:
            source = handle.read()
    except OSError as exc:
        sys.stderr.write(f"{sys.orig_argv[0]}: can't open file {path!r}: "
                         f"[Errno {exc.errno}] {exc.strerror}\n")
        raise SystemExit(2) from None
    if not sys.flags.isolated and not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(path)  # as `python script.py` would have it
    main = type(sys)("__main__")
    main.__file__ = path
    main.__cached__ = None
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv[:] = args
    try:
        code = compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte, before 3.11.4
        exc.__traceback__ = None
        sys.excepthook(type(exc), exc, None)
        raise SystemExit(1) from None
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        exc.__traceback__ = exc.__traceback__.tb_next
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None
_run(_take())
"""


@dataclass(frozen=True)
class WarmKind:
    """What a warm sandbox runs once handed out, and so which runs it can serve.

    Attributes:
        name: "python" (the python tool's interpreter, started) or "exec" (any command
            with no extra environment: the shell tool's ``sh -c …``).
        prefix: The start of the commands it serves; the rest are the arguments it is given.
        env: The extra environment of the commands it serves (exactly this one).
        launcher: The command started ahead.
    """

    name: str
    prefix: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    launcher: tuple[str, ...]

    def arguments_for(self, argv: list[str], env: Mapping[str, str],
                      files: Mapping[str, str | bytes]) -> list[str] | None:
        """The arguments to hand a sandbox of this kind for ``argv`` run with ``env``, or
        None when this kind cannot run it exactly as a sandbox started for it would."""
        if dict(self.env) != dict(env) or tuple(argv[:len(self.prefix)]) != self.prefix:
            return None
        rest = argv[len(self.prefix):]
        if not rest or any("\0" in arg for arg in rest):
            return None  # nothing to run, or what no exec could take (NUL)
        # The python kind runs a script of the run's own input files; an option such as
        # -c or -m, or a script path elsewhere, needs the interpreter's own handling.
        if self.name == "python" and (rest[0] not in files or _has_nul(files[rest[0]])):
            return None  # (the interpreters differ on a NUL byte in a source file)
        return rest


def _has_nul(content: str | bytes) -> bool:
    if isinstance(content, str):
        return "\0" in content
    return b"\0" in content


def kinds_for(settings: Settings) -> dict[str, WarmKind]:
    """The warm kinds: "python" for the python tool, "exec" for the shell tool (and any
    other command with no extra environment)."""
    python = (settings.sandbox_python, *PYTHON_FLAGS)
    return {
        "python": WarmKind("python", python, tuple(sorted(PYTHON_ENV.items())),
                           (*python, "-c", PY_LAUNCHER)),
        "exec": WarmKind("exec", (), (), ("sh", "-c", SH_LAUNCHER)),
    }


def encode_arguments(args: list[str]) -> bytes:
    """The argument lines of the hand-out (see the module docstring)."""
    lines = [str(len(args)).encode()]
    for arg in args:
        lines.append(os.fsencode(arg).replace(b"\\", b"\\\\").replace(b"\n", b"\\n"))
    return b"\n".join(lines) + b"\n"


class Unfit(Exception):
    """A warm sandbox that must not be handed out; the message says why."""


#: A file's identity and every attribute a change to it (or below it) moves.
_StatKey = tuple[int, int, int, int, int, int, int, int]


def _stat_key(info: os.stat_result) -> _StatKey:
    return (info.st_ino, info.st_mode, info.st_uid, info.st_gid, info.st_nlink, info.st_size,
            info.st_mtime_ns, info.st_ctime_ns)


def _folder_state(workdir: _Workdir) -> tuple[object, ...]:
    """What the folder looks like: itself (by its fd and by its name in the root) and
    each entry (by name, never following a link)."""
    entries = sorted(os.listdir(workdir.fd))
    return (_stat_key(os.fstat(workdir.fd)),
            _stat_key(os.stat(workdir.name, dir_fd=workdir.root_fd, follow_symlinks=False)),
            tuple((name, _stat_key(os.stat(name, dir_fd=workdir.fd, follow_symlinks=False)))
                  for name in entries))


@dataclass(frozen=True)
class _Process:
    pid: int
    start_time: int
    uids: bytes
    state: bytes
    tracer: bytes


def _tree(root: int) -> dict[int, _Process]:
    """The live processes of ``root``'s tree, from /proc (a process gone meanwhile is
    left out)."""
    found: dict[int, _Process] = {}
    pending = [root]
    while pending and len(found) < 64:
        pid = pending.pop()
        if pid in found:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/status", "rb") as handle:
                status = dict(line.split(b":", 1) for line in handle.read().splitlines()
                              if b":" in line)
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        # After the ")" of the command name: the state is the 1st field, the start time
        # (clock ticks since boot) the 20th.
        found[pid] = _Process(pid, int(fields[19]), status.get(b"Uid", b"").strip(),
                              fields[0], status.get(b"TracerPid", b"").strip())
        for task in tasks:
            with contextlib.suppress(OSError), \
                    open(f"/proc/{pid}/task/{task}/children", "rb") as handle:
                pending.extend(int(child) for child in handle.read().split())
    return found


def _remove_unused(making: asyncio.Future[_Workdir]) -> None:
    """Removes a folder made for a start that was cancelled meanwhile."""
    if not making.cancelled() and making.exception() is None:
        _finish(making.result(), False)


def _namespace_init(leader: int, processes: dict[int, _Process]) -> int:
    """A pidfd of the leader's one child, the init of the sandbox's PID namespace (the
    child ``bwrap`` or ``unshare --fork`` made), or -1 when it is not one child. The
    hand-out's check of the tree (pid and start time) makes sure it is the same process."""
    try:
        with open(f"/proc/{leader}/task/{leader}/children", "rb") as handle:
            children = [int(child) for child in handle.read().split()]
        if len(children) != 1 or children[0] not in processes:
            return -1
        return os.pidfd_open(children[0])
    except OSError:
        return -1


class WarmSandbox:
    """A sandbox started ahead, its launcher waiting (see the module docstring).

    Attributes:
        kind: What it runs once handed out.
        pid: Its leader's process id.
        workdir: Its working directory.
    """

    kind: WarmKind
    pid: int
    workdir: _Workdir
    _leader: _Leader
    _stdout: asyncio.StreamReader | None
    _stdin: asyncio.StreamWriter | None
    _folder: tuple[object, ...]
    _processes: dict[int, _Process]
    _handed: bool
    _closed: bool

    def __init__(self, kind: WarmKind, workdir: _Workdir, leader: _Leader) -> None:
        self.kind = kind
        self.workdir = workdir
        self.pid = leader.proc.pid
        self._leader = leader
        self._stdout = None
        self._stdin = None
        self._folder = ()
        self._processes = {}
        self._handed = False
        self._closed = False

    @property
    def exited(self) -> asyncio.Future[None]:
        """Done once its leader has exited."""
        return self._leader.exited

    @classmethod
    async def start(cls, sandbox: Sandbox, kind: WarmKind) -> WarmSandbox:
        """Starts one, as ``sandbox`` starts a run's, and waits for its ``ready``.

        Raises:
            RuntimeError: It did not start (what it said is in the message).
            OSError: Its folder could not be made, or its command not started.
        """
        # A fresh folder and a user id of its own (taking one scans /proc: in a thread,
        # which goes on when the start is cancelled: what it made is then removed).
        making = asyncio.ensure_future(asyncio.to_thread(sandbox._make_workdir, {}))
        try:
            workdir = await asyncio.shield(making)
        except asyncio.CancelledError:
            making.add_done_callback(_remove_unused)
            raise
        try:
            leader = _Leader(sandbox._command(list(kind.launcher), workdir), workdir,
                             sandbox._environment(workdir.path, dict(kind.env)),
                             stdin=subprocess.PIPE)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(_finish, workdir, False))
            raise
        warm = cls(kind, workdir, leader)
        try:
            warm._stdout = await leader.read_pipe(leader.proc.stdout)
            warm._stdin = await leader.write_pipe(leader.proc.stdin)
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                # that lands as the line arrives.
                async with asyncio.timeout(START_SECONDS):
                    said = await warm._stdout.readline()
            except TimeoutError:
                said = b"(nothing within %d s)" % START_SECONDS
            if said != b"ready\n":
                raise RuntimeError(f"a warm {kind.name} sandbox did not start: it said "
                                   f"{said[:200]!r}{warm._stderr_now()}")
            warm._folder = _folder_state(workdir)
            warm._processes = _tree(warm.pid)
            if sandbox.isolation.mode != "rlimits":
                leader.namespace_init = _namespace_init(warm.pid, warm._processes)
        except BaseException:
            await warm.aclose()
            raise
        return warm

    def _stderr_now(self) -> str:
        """What it wrote on stderr so far (for the error of a start that failed)."""
        pipe = self._leader.proc.stderr
        if pipe is None or pipe.closed or not select.select([pipe], [], [], 0)[0]:
            return ""
        with contextlib.suppress(OSError):
            return f"; on stderr: {os.read(pipe.fileno(), 500)!r}"
        return ""

    def unfit(self) -> str | None:
        """Why it must not be handed out, or None: what a sandbox touched while it waited
        shows (see the module docstring). Never raises."""
        if self._closed or self._handed:
            return "it was already closed or handed out"
        if self._leader.exited.done():
            return "its process exited while it waited"
        stderr = self._leader.proc.stderr
        try:
            if stderr is None or select.select([stderr], [], [], 0)[0]:
                return "its stderr was written to or closed while it waited"
            folder = _folder_state(self.workdir)
        except (OSError, ValueError) as exc:
            return f"its folder could not be checked: {exc}"
        if folder != self._folder:
            return "its folder changed while it waited"
        now = _tree(self.pid)
        if now.keys() != self._processes.keys():
            return "its processes changed while it waited (one appeared or went)"
        for pid, process in now.items():
            before = self._processes[pid]
            if (process.start_time, process.uids) != (before.start_time, before.uids):
                return f"process {pid} of it is not the one started (identity or ids changed)"
            if process.state[:1] not in (b"S", b"R", b"D") or process.tracer != b"0":
                return f"process {pid} of it was stopped or traced while it waited"
        return None

    async def hand_out(self, arguments: list[str], files: Mapping[str, str | bytes],
                       limits: Limits) -> WarmStart:
        """Checks it (:meth:`unfit`), writes the run's input files into its folder, gives
        it a nonce and the arguments, and reads its answer to the nonce: from then on it
        runs the run's command and belongs to that run.

        Raises:
            Unfit: It must not be handed out; the caller destroys it (:meth:`aclose`),
                and with it whatever of the command it may have begun (in its own folder,
                which is removed; the run then starts a sandbox of its own).
        """
        reason = self.unfit()
        if reason is not None:
            raise Unfit(reason)
        assert self._stdin is not None and self._stdout is not None
        nonce = secrets.token_hex(16).encode()
        try:
            write_inputs(self.workdir, files, limits)
            # The nonce and the arguments in one write: the launcher answers and goes on
            # at once, rather than sleeping until a second write wakes it (two process
            # switches fewer per call on a busy machine).
            self._stdin.write(nonce + b"\n" + encode_arguments(arguments))
            self._stdin.close()
            async with asyncio.timeout(HANDSHAKE_SECONDS):
                answer = await self._stdout.readline()
        except (TimeoutError, OSError, ConnectionError) as exc:
            raise Unfit(f"it did not answer the hand-out ({type(exc).__name__})") from exc
        if answer != b"fresh " + nonce + b"\n":
            raise Unfit("it answered the hand-out wrongly")
        self._handed = True
        return WarmStart(self.workdir, self._leader, self._stdout)

    async def aclose(self) -> None:
        """Destroys it (not once handed out: the run it went to ends it); safe to call more
        than once."""
        if self._closed or self._handed:
            return
        self._closed = True
        if self._stdin is not None:
            with contextlib.suppress(Exception):
                self._stdin.close()
        await self._leader.end(self.workdir, [], drain=False)
        await asyncio.shield(asyncio.to_thread(_finish, self.workdir, False))
