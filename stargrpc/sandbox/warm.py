"""Sandboxes started ahead of their run: the launcher that waits in one, and its hand-out.

A warm sandbox is started exactly as a run's sandbox is (:meth:`Sandbox._make_workdir`: a
fresh folder and a user id of its own; :meth:`Sandbox._command`: the same ``setpriv``,
``prlimit`` and isolation wrapper), only its command is a *launcher* that says ``ready``
and waits on its stdin (one end of a Unix socket pair, the *control channel*) for the one
command it will run. It serves exactly one run and is then destroyed like any run's sandbox.

What is fixed when it starts, and must therefore match the run exactly (else the run starts
a sandbox of its own): the isolation, the sandbox root, the user ids, the limits, the
environment (the server's allowlisted variables and the run's extra ones: a
:class:`WarmKind` serves one extra environment only), the host folders it is shown, and the
interpreter for ``python``. With the state socket on (``sandbox_state_scopes`` not empty)
the kinds are started as a run with a state socket is: the client's folder shown
read-only, the client on ``PATH`` and ``PYTHONPATH``, and a state socket inherited at
``$STARGRPC_STATE_FD``; they serve only runs with a state socket. That socket is the
sandbox's own, made at its start (a ``SOCK_SEQPACKET`` pair, as a run's): nothing serves
the server's end of it while the sandbox waits, and at hand-out the run's
:class:`~stargrpc.sandbox.state_socket.StateSocket` adopts that end, so that from then on
what comes on it is served as the run's (no descriptor crosses at hand-out, so the
launcher can be ``sh``). What is given at hand-out: the input files (written by the server
through the folder's fd, as for any run) and the command's arguments.

The hand-out, over the control channel and the sandbox's stdout (one line each)::

    launcher -> server   ready                 (once started; on stdout)
    server -> launcher   <nonce>               (128 random bits, hex), then <count>, then
                         for each argument the number of its lines and those lines (the
                         argument split at its newlines) (one write)
    launcher -> server   fresh <nonce>         (on stdout)
    server               closes the control channel; with the state socket on, the run's
                         state socket adopts the sandbox's (only now)
    launcher             stdin becomes /dev/null; runs the command (``exec``, or the Python
                         snippet in the interpreter already started)

The server writes the run's input files before it sends the nonce: the launcher runs the
command as soon as it has its arguments. It starts streaming the command's output, and
serving the sandbox's state socket as the run's, only once the answer is right; a sandbox
that answers wrongly or not within :data:`HANDSHAKE_SECONDS` is destroyed with whatever it
began (what it sent on its state socket is never served), and the run starts its own.

Before anything is written, :meth:`WarmSandbox.unfit` checks that nothing touched it while it
waited: its leader alive (through its pidfd), its process tree the same processes (pid and
start time), none stopped or traced, with the same user ids; nothing on its stderr; its
folder the same inode at the same name with the same entries, each unchanged (inode, size,
mode, owner, links, mtime, ctime; ``out/`` and ``tmp/`` empty, so anything added below them
changes them too); nothing sent on its state socket. A sandbox that fails a check, or does
not answer the nonce, is destroyed and never given to a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import SupportsIndex

from stargrpc.sandbox.rlimits import Limits
from stargrpc.sandbox.runner import (
    AdoptState,
    Sandbox,
    WarmStart,
    _finish,
    _Leader,
    _read_proc,
    _readable_now,
    _status_line,
    _Workdir,
    sandbox_root,
    write_inputs,
)
from stargrpc.sandbox.state_client import FD_VARIABLE
from stargrpc.sandbox.state_socket import client_dir, state_env
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

#: The most bytes, and lines, of arguments (as the hand-out sends them) a command served by
#: the ``sh`` launcher may have: ``read`` in ``sh`` takes a byte per system call (0.5-0.8 us
#: a byte measured), and each line joined to an argument copies it whole (16,000 newlines
#: took 150 ms, 256 lines of 60 bytes 11 ms): past these, starting a sandbox for the
#: command is quicker.
MAX_SH_HANDOUT_BYTES = 16 * 1024
MAX_SH_HANDOUT_LINES = 256

#: The launcher of commands run with ``exec`` (the shell tool's ``sh -c …`` and any other
#: command with no extra environment but the state socket's), in POSIX sh: its builtins
#: only, so that what it costs the run before ``exec`` (CPU time counts against the run's
#: limit) is a few microseconds. ``read -r`` takes a line as it is (an argument's newlines
#: are where it was split into lines), and ``exec`` keeps the descriptors it was started
#: with (the state socket). (Its stdin is the control channel, a socket.)
SH_LAUNCHER = r"""printf 'ready\n'
IFS= read -r nonce || exit 0
printf 'fresh %s\n' "$nonce"
IFS= read -r count || exit 0
set --
while [ "$count" -gt 0 ]; do
  IFS= read -r lines || exit 0
  arg=
  while [ "$lines" -gt 0 ]; do
    IFS= read -r line || exit 0
    arg=$arg$line
    lines=$((lines - 1))
    if [ "$lines" -gt 0 ]; then arg="$arg
"; fi
  done
  set -- "$@" "$arg"
  count=$((count - 1))
done
exec "$@" </dev/null
"""

#: How the Python launcher takes its command: the hand-out's lines from the control
#: channel on fd 0, then stdin made ``/dev/null``. The control channel closed before the
#: end (the hand-out given up): exit 0. Only the built-in ``_socket`` is imported, not
#: ``socket`` (which brings ``enum``, ``selectors`` and their classes): the interpreter a
#: run is handed holds the modules a cold one would, and its exit has no more of them to
#: tear down.
_PY_TAKE = r"""import os, sys, _socket
def _take():
    os.write(1, b"ready\n")
    control = _socket.socket(fileno=0)
    pending = b""
    def line():
        nonlocal pending
        while b"\n" not in pending:
            chunk = control.recv(65536)
            if not chunk:
                os._exit(0)
            pending += chunk
        head, _, pending = pending.partition(b"\n")
        return head
    nonce = line()
    os.write(1, b"fresh " + nonce + b"\n")
    args = [os.fsdecode(b"\n".join([line() for _ in range(int(line()))]))
            for _ in range(int(line()))]
    control.detach()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return args
"""

#: How the python tool's launcher ends once the snippet has (exit status ``code``): the
#: ``threading`` module's non-daemon threads joined, as a normal exit begins; then, when
#: nothing that the rest of a normal exit does could be seen, ``sys.stdout``, ``sys.stderr``
#: and the files left open flushed and ``os._exit``; otherwise it returns and the
#: interpreter exits normally (joining the threads again does nothing). The run's Result
#: waits for this process to exit, and the interpreter's teardown (collections of every
#: object, each module cleared, the heap freed) was most of the time from the snippet's
#: end to its Result. What the rest of a normal exit does that can be seen: ``atexit``
#: handlers (so: none registered; run by the exit itself, a failing one is reported as a
#: cold run reports it) and finalisers. So ``os._exit`` only when every object the
#: collector tracks (at most ``_LEAVE_OBJECTS``) has no finaliser, or is a file object of
#: ``_io``'s own (its buffer flushed here as its finaliser would), a closed socket, a weak
#: reference with no callback or the ``abc`` caches' own, or a class with no ``__del__`` of
#: its own or whose instances the collector tracks; no thread is left; ``sys.stdout`` and
#: ``sys.stderr`` are the interpreter's own; the warning filters are as at start-up (an
#: unclosed file's ``ResourceWarning`` stays ignored); and every extension module loaded
#: is one of the standard library's whose objects do nothing at teardown but what the
#: kernel does at exit (``_PLAIN_EXTENSIONS``: not ``ctypes``, ``sqlite3``, ``dbm``,
#: ``ssl``, ``curses``, ``readline``, ``multiprocessing``; none from elsewhere: C buffers,
#: C exit handlers). Before the snippet it uses only modules a cold interpreter has loaded;
#: ``gc`` and ``atexit`` (built in) after it.
_PY_LEAVE = r"""import _imp, _io, _thread, _warnings, _weakref
_STDOUT, _STDERR = sys.stdout, sys.stderr
_FILTERS = list(_warnings.filters)
_DYNLOAD = os.path.join(os.path.dirname(os.__file__), "lib-dynload")
_LEAVE_OBJECTS = 100_000
_PLAIN_EXTENSIONS = frozenset((
    "_asyncio", "_bz2", "_codecs_cn", "_codecs_hk", "_codecs_iso2022", "_codecs_jp",
    "_codecs_kr", "_codecs_tw", "_contextvars", "_crypt", "_decimal", "_hashlib", "_json",
    "_lsprof", "_lzma", "_multibytecodec", "_queue", "_typing", "_uuid", "_zoneinfo",
    "audioop", "mmap", "resource", "termios"))
_FLUSHED = (_io.TextIOWrapper, _io.BufferedWriter, _io.BufferedRandom, _io.BufferedRWPair)
_CLOSED_ONLY = (_io.FileIO, _io.BufferedReader, _io.BytesIO, _io.StringIO)
_SLOT = type(object.__init__)  # a C type's own slot (its finaliser is of a plain module)
def _plain_modules():
    suffixes = tuple(_imp.extension_suffixes())
    for module in list(sys.modules.values()):
        if not isinstance(module, type(sys)):
            continue  # (typing puts classes there)
        path = module.__dict__.get("__file__")
        if isinstance(path, str) and path.endswith(suffixes) and (
                os.path.dirname(path) != _DYNLOAD
                or os.path.basename(path).split(".")[0] not in _PLAIN_EXTENSIONS):
            return False
    return True
def _kind(cls):
    # 0: nothing at teardown; 1: a file whose buffer is flushed; 2: a socket, fine closed;
    # 3: a weak reference; 4: a class; None: a finaliser that may do anything.
    if issubclass(cls, type):  # a class; a metaclass's own __del__ runs at teardown
        return 4 if _finaliser(cls) is None else None
    if issubclass(cls, _weakref.ref):
        return 3
    if cls in (_weakref.ProxyType, _weakref.CallableProxyType):
        return None  # its callback, if any, cannot be seen
    if cls in _FLUSHED:
        return 1
    if cls in _CLOSED_ONLY:
        return 0
    if cls is _socket.socket:
        return 2
    return None if _finaliser(cls) is not None else 0
def _finaliser(cls):
    # Its __del__, looked up without running any code of the snippet's (a metaclass's).
    for base in type.__dict__["__mro__"].__get__(cls):
        found = type.__dict__["__dict__"].__get__(base).get("__del__")
        if found is not None:
            return found
    return None
def _abc_callback(callback):
    return (type(callback) is type(len) and callback.__name__ == "_destroy"
            and isinstance(callback.__self__, _weakref.ref))
def _to_flush():
    import gc
    objects = gc.get_objects()
    if len(objects) > _LEAVE_OBJECTS:
        return None
    kinds = {}
    for cls in set(map(type, objects)):
        kind = _kind(cls)
        if kind is None:
            return None
        if kind:
            kinds[cls] = kind
    files = []
    for obj in objects:
        kind = kinds.get(type(obj))
        if kind is None:
            continue
        if kind == 1:
            if not obj.closed and obj.writable():
                files.append(obj)
        elif kind == 2:
            if obj.fileno() != -1:
                return None
        elif kind == 3:
            if obj.__callback__ is not None and not _abc_callback(obj.__callback__):
                return None
        elif (not type.__dict__["__flags__"].__get__(obj) & (1 << 14)
                and type(_finaliser(obj)) not in (type(None), _SLOT)):
            return None  # a class's own __del__, on instances the collector misses
    return files
def _leave(code):
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        import atexit
        if atexit._ncallbacks():
            return  # run by the exit itself: from here a failing one's report would differ
        if (sys.stdout is not _STDOUT or sys.stderr is not _STDERR or _thread._count()
                or _warnings.filters != _FILTERS or not _plain_modules()):
            return
        files = _to_flush()
        if files is None:
            return
        for stream in (_STDOUT, _STDERR, *files):
            if not stream.closed:
                stream.flush()
    except BaseException:
        return  # the normal exit does it all (again) and reports what fails
    os._exit(code)
"""

#: The launcher of the python tool: the interpreter started with the tool's flags and
#: environment, then given the script's arguments and running it as ``__main__`` as
#: ``python3 -s -u SCRIPT`` would (``__file__`` absolute, ``sys.argv`` the arguments, no
#: launcher frame in a traceback, exit status 1 on an uncaught exception and 2 when the
#: script cannot be opened). What differs: ``sys.orig_argv`` and ``/proc/self/cmdline``
#: show the launcher, a frame of it sits under the script's on the stack, and a source the
#: compiler refuses before parsing (a NUL byte) is reported without its line.
PY_LAUNCHER = _PY_TAKE + r"""def _run(args):
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
""" + _PY_LEAVE + r"""# The first compile pays for the parser's set-up (1-1.5 ms measured; the next
# one of a small script 0.03 ms): paid here, before the hand-out. It imports nothing.
compile("", "<warm>", "exec", dont_inherit=True)
_code = 0
try:
    _run(_take())
except SystemExit as _exit:
    _code = _exit.code
    if _code is None:
        _code = 0
    elif type(_code) is not int or not 0 <= _code <= 255:
        raise  # printed and exit status 1, by the interpreter's own exit
_leave(_code)
if _code:
    raise SystemExit(_code)
"""

@dataclass(frozen=True)
class WarmKind:
    """What a warm sandbox runs once handed out, and so which runs it can serve.

    Attributes:
        name: "python" (the python tool's interpreter, started) or "exec" (any command
            with no extra environment but the state socket's: the shell tool's ``sh -c …``).
        prefix: The start of the commands it serves; the rest are the arguments it is given.
        env: The extra environment of the commands it serves (exactly this one, but for
            ``$STARGRPC_STATE_FD``: each sandbox of a kind that takes the state socket gets
            the number of its own).
        launcher: The command started ahead.
        read_only_paths: The host folders it is shown (the state client's, or none).
        takes_state: It serves only runs with a state socket (and no other descriptor):
            it is started with a state socket of its own, which the run's adopts at
            hand-out.
    """

    name: str
    prefix: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    launcher: tuple[str, ...]
    read_only_paths: tuple[Path, ...] = ()
    takes_state: bool = False

    def match(self, argv: list[str], env: Mapping[str, str], files: Mapping[str, str | bytes],
              pass_fds: Sequence[int], read_only_paths: Sequence[Path], *,
              adoptable: bool = False) -> bytes | None:
        """The argument lines (:func:`encode_arguments`) to hand a sandbox of this kind for
        ``argv`` run with ``env``,
        inheriting ``pass_fds`` and shown ``read_only_paths``; None when this kind cannot
        run it exactly as a sandbox started for it would. A kind that takes the state
        socket serves a run whose one descriptor is its state socket (named by its
        ``$STARGRPC_STATE_FD``) when that socket can adopt the sandbox's own
        (``adoptable``); the others, runs that inherit none."""
        if tuple(read_only_paths) != self.read_only_paths:
            return None
        if self.takes_state:
            if (not adoptable or len(pass_fds) != 1
                    or env.get(FD_VARIABLE) != str(pass_fds[0])):
                return None
            env = {name: value for name, value in env.items() if name != FD_VARIABLE}
        elif pass_fds:
            return None
        return self.arguments_for(argv, env, files)

    def arguments_for(self, argv: list[str], env: Mapping[str, str],
                      files: Mapping[str, str | bytes]) -> bytes | None:
        """The argument lines to hand a sandbox of this kind for ``argv`` run with ``env``
        (without its ``$STARGRPC_STATE_FD``), or None when this kind cannot run it exactly
        as a sandbox started for it would."""
        if dict(self.env) != dict(env) or tuple(argv[:len(self.prefix)]) != self.prefix:
            return None
        rest = argv[len(self.prefix):]
        if not rest or any("\0" in arg for arg in rest):
            return None  # nothing to run, or what no exec could take (NUL)
        # The python kind runs a script of the run's own input files; an option such as
        # -c or -m, or a script path elsewhere, needs the interpreter's own handling.
        if self.name == "python" and (rest[0] not in files or _has_nul(files[rest[0]])):
            return None  # (the interpreters differ on a NUL byte in a source file)
        handed = encode_arguments(rest)
        if self.name == "exec" and (len(handed) > MAX_SH_HANDOUT_BYTES
                                    or handed.count(b"\n") > MAX_SH_HANDOUT_LINES):
            return None  # quicker started for it than read by sh a byte at a time
        return handed


def _has_nul(content: str | bytes) -> bool:
    if isinstance(content, str):
        return "\0" in content
    return b"\0" in content


def kinds_for(settings: Settings) -> dict[str, WarmKind]:
    """The warm kinds: "python" for the python tool, "exec" for the shell tool (and any
    other command with no extra environment); with the state socket on
    (``sandbox_state_scopes``), both started as a run with a state socket is, to serve
    only such runs."""
    python = (settings.sandbox_python, *PYTHON_FLAGS)
    launchers = {"python": (*python, "-c", PY_LAUNCHER), "exec": ("sh", "-c", SH_LAUNCHER)}
    if not settings.sandbox_state_scopes:
        return {
            "python": WarmKind("python", python, tuple(sorted(PYTHON_ENV.items())),
                               launchers["python"]),
            "exec": WarmKind("exec", (), (), launchers["exec"]),
        }
    client = client_dir(sandbox_root(settings), settings.sandbox_python)
    # The client on PATH and PYTHONPATH; $STARGRPC_STATE_FD is set per sandbox.
    state = {name: value for name, value in state_env(client, -1).items()
             if name != FD_VARIABLE}
    return {
        "python": WarmKind("python", python, tuple(sorted({**PYTHON_ENV, **state}.items())),
                           launchers["python"], (client,), takes_state=True),
        "exec": WarmKind("exec", (), tuple(sorted(state.items())), launchers["exec"],
                         (client,), takes_state=True),
    }


def encode_arguments(args: list[str]) -> bytes:
    """The argument lines of the hand-out (see the module docstring)."""
    lines = [str(len(args)).encode()]
    for arg in args:
        parts = os.fsencode(arg).split(b"\n")
        lines.append(str(len(parts)).encode())
        lines.extend(parts)
    return b"\n".join(lines) + b"\n"


class _NotingReader(asyncio.StreamReader):
    """A stream reader that notes in ``came`` whether anything came on its pipe (data, or
    the pipe's end) since it was connected."""

    came = False

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        self.came = True
        super().feed_data(data)

    def feed_eof(self) -> None:
        self.came = True
        super().feed_eof()


class Unfit(Exception):
    """A warm sandbox that must not be handed out; the message says why.

    Attributes:
        reason: Why in a word, the label the pool discards it under: ``tampered`` (touched
            while it waited, or a wrong or no answer to the hand-out), or ``setup_failed``
            (the run's input files could not be written into its folder: a full disk, say
            — not a sign that anything touched it).
    """

    reason: str

    def __init__(self, message: str, reason: str = "tampered") -> None:
        super().__init__(message)
        self.reason = reason


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
            fields = _read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
            status = _read_proc(f"/proc/{pid}/status")
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        # After the ")" of the command name: the state is the 1st field, the start time
        # (clock ticks since boot) the 20th.
        found[pid] = _Process(pid, int(fields[19]), _status_line(status, b"Uid"),
                              fields[0], _status_line(status, b"TracerPid"))
        for task in tasks:
            with contextlib.suppress(OSError):
                pending.extend(int(child) for child in
                               _read_proc(f"/proc/{pid}/task/{task}/children").split())
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
    _stderr: _NotingReader | None
    _control: socket.socket
    #: Its own state socket (kinds that take one), until adopted: the server's end and
    #: the sandbox's, which the server keeps open too, as it does a run's (see
    #: StateSocket.adopt).
    _state: tuple[socket.socket, socket.socket] | None
    _folder: tuple[object, ...]
    _processes: dict[int, _Process]
    _handed: bool
    _closed: bool

    def __init__(self, kind: WarmKind, workdir: _Workdir, leader: _Leader,
                 control: socket.socket,
                 state: tuple[socket.socket, socket.socket] | None = None) -> None:
        self.kind = kind
        self.workdir = workdir
        self.pid = leader.proc.pid
        self._leader = leader
        self._stdout = None
        self._stderr = None
        self._control = control
        self._state = state
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
        # The control channel: a socket pair (its stdin); and, for a kind that takes the
        # state socket, a state socket of its own, made as a run's is.
        control, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        state: tuple[socket.socket, socket.socket] | None = None
        env = dict(kind.env)
        try:
            if kind.takes_state:
                state = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                state[0].setblocking(False)
                env[FD_VARIABLE] = str(state[1].fileno())
            leader = _Leader(sandbox._command(list(kind.launcher), workdir,
                                              kind.read_only_paths),
                             workdir, sandbox._environment(workdir.path, env),
                             stdin=child.fileno(),
                             pass_fds=[state[1].fileno()] if state is not None else [])
        except BaseException:
            control.close()
            for end in state or ():
                end.close()
            await asyncio.shield(asyncio.to_thread(_finish, workdir, False))
            raise
        finally:
            child.close()
        control.setblocking(False)
        warm = cls(kind, workdir, leader, control, state)
        try:
            warm._stdout = await leader.read_pipe(leader.proc.stdout)
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
            # What it looks like as it says ready, with no turn of the loop in between.
            warm._folder = _folder_state(workdir)
            warm._processes = _tree(warm.pid)
            # Its stderr connected now, not on the hand-out's path (a turn of the loop
            # fewer there); what comes on it from its ready on is noted (see unfit).
            if sandbox.isolation.mode != "rlimits":
                leader.namespace_init = _namespace_init(warm.pid, warm._processes)
            warm._stderr = _NotingReader()
            await leader.read_pipe(leader.proc.stderr, reader=warm._stderr)
        except BaseException:
            await warm.aclose()
            raise
        return warm

    def _stderr_now(self) -> str:
        """What it wrote on stderr so far (for the error of a start that failed)."""
        pipe = self._leader.proc.stderr
        if pipe is None or pipe.closed or not _readable_now(pipe):
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
            # What its reader took off the pipe, or what waits there for the reader.
            if (stderr is None or self._stderr is None or self._stderr.came
                    or _readable_now(stderr)):
                return "its stderr was written to or closed while it waited"
            # Its state socket: nothing serves it before the hand-out, so whatever waits
            # there was sent while it waited.
            if self._state is not None and _readable_now(self._state[0]):
                return "its state socket was used while it waited"
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

    async def hand_out(self, handed: bytes, files: Mapping[str, str | bytes],
                       limits: Limits,
                       adopt_state: AdoptState | None = None) -> WarmStart:
        """Checks it (:meth:`unfit`), writes the run's input files into its folder, gives
        it a nonce and the argument lines ``handed`` (:func:`encode_arguments`, as
        :meth:`WarmKind.match` gives them) and reads its answer to the nonce; once the answer is
        right, gives its own state socket to ``adopt_state`` (the run's state socket's
        :meth:`~stargrpc.sandbox.state_socket.StateSocket.adopt`, required when its kind
        takes the state socket): from then on it runs the run's command and belongs to
        that run.

        Raises:
            Unfit: It must not be handed out; the caller destroys it (:meth:`aclose`),
                and with it whatever of the command it may have begun (in its own folder,
                which is removed; the run then starts a sandbox of its own).
        """
        if (adopt_state is not None) != self.kind.takes_state:
            raise ValueError(f"a {self.kind.name} sandbox "
                             f"{'needs' if self.kind.takes_state else 'takes no'} "
                             "state socket to adopt its own")
        try:
            await self._hand_out(handed, files, limits)
        except Unfit:
            self._control.close()  # its launcher, if it still listens, gets nothing more
            raise
        assert self._stdout is not None and self._stderr is not None
        if adopt_state is not None:
            # Only now, from a sandbox that proved itself fresh: what it sends on its
            # state socket is served as the run's. Before it is marked handed: should the
            # adoption fail, the caller's aclose still destroys it, its ends included.
            assert self._state is not None
            adopt_state(*self._state)
            self._state = None
        self._handed = True
        return WarmStart(self.workdir, self._leader, self._stdout, self._stderr,
                         asyncio.get_running_loop().create_future())

    async def _hand_out(self, handed: bytes, files: Mapping[str, str | bytes],
                        limits: Limits) -> None:
        reason = self.unfit()
        if reason is not None:
            raise Unfit(reason)
        assert self._stdout is not None
        nonce = secrets.token_hex(16).encode()
        # Its launcher runs the command as soon as it has the arguments: the files first.
        self._write_inputs(files, limits)
        try:
            async with asyncio.timeout(HANDSHAKE_SECONDS):
                # The nonce and the arguments in one write: the launcher answers and goes
                # on at once, rather than sleeping until a second write wakes it (two
                # process switches fewer per call on a busy machine).
                await asyncio.get_running_loop().sock_sendall(
                    self._control, nonce + b"\n" + handed)
                answer = await self._stdout.readline()
        except (TimeoutError, OSError, ConnectionError) as exc:
            raise Unfit(f"it did not answer the hand-out ({type(exc).__name__})") from exc
        if answer != b"fresh " + nonce + b"\n":
            raise Unfit("it answered the hand-out wrongly")
        self._control.close()

    def _write_inputs(self, files: Mapping[str, str | bytes], limits: Limits) -> None:
        """Writes the run's input files into its folder.

        Raises:
            Unfit: They could not be written (reason ``setup_failed``): the server's
                trouble, not the sandbox's, so it is not counted as tampered with.
        """
        try:
            write_inputs(self.workdir, files, limits)
        except OSError as exc:
            raise Unfit(f"the run's input files could not be written: {exc.strerror}",
                        reason="setup_failed") from exc

    async def aclose(self) -> None:
        """Destroys it (not once handed out: the run it went to ends it); safe to call more
        than once."""
        if self._closed or self._handed:
            return
        self._closed = True
        self._control.close()
        for end in self._state or ():
            end.close()
        self._state = None
        await self._leader.end(self.workdir, [], drain=False)
        await asyncio.shield(asyncio.to_thread(_finish, self.workdir, False))
