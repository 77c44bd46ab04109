"""The sandbox warm pool: one run per pooled sandbox, matched exactly, never a touched one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import select
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from stargrpc.metrics import REGISTRY
from stargrpc.runs.state import RunState
from stargrpc.sandbox import Limits, Sandbox, runner
from stargrpc.sandbox.isolation import SANDBOX_PATH
from stargrpc.sandbox.pool import WarmPool
from stargrpc.sandbox.runner import (
    OutputCallback,
    SandboxResult,
    WarmStart,
    _live_processes,
    sandbox_root,
)
from stargrpc.sandbox.state_socket import StateSocket, client_dir
from stargrpc.sandbox.warm import (
    _PY_LEAVE,
    MAX_SH_HANDOUT_BYTES,
    MAX_SH_HANDOUT_LINES,
    PYTHON_ENV,
    PYTHON_FLAGS,
    Unfit,
    WarmSandbox,
    _tree,
    encode_arguments,
    kinds_for,
)
from stargrpc.settings import MiB, Settings
from stargrpc.stores.memory import MemoryStateStore
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, eventually, run_tool

SMALL = Limits(cpu_seconds=2, memory_bytes=256 * MiB, file_size_bytes=16 * MiB,
               max_processes=32, wall_clock_seconds=20, output_bytes=64 * 1024)

#: What a snippet can see of its interpreter and folder; equal warm or cold.
INTROSPECT = """import json, os, sys
print(json.dumps({"argv": sys.argv, "file": __file__, "name": __name__,
                  "cwd": os.getcwd(), "listing": sorted(os.listdir(".")),
                  "stdin": sys.stdin.read(), "path": sys.path, "flags": list(sys.flags),
                  "env": sorted(os.environ), "uid_is_root": os.getuid() == 0}))
def fail():
    raise ValueError("boom")
fail()
"""

PoolFactory = Callable[..., Awaitable[WarmPool]]


def settings(tmp_path: Path, **overrides: Any) -> Settings:
    return Settings.load(state_dir=tmp_path / "state", **overrides)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"stargrpc_sandbox_pool_{name}_total", labels) or 0.0


@pytest.fixture
async def make_pool(tmp_path) -> AsyncIterator[PoolFactory]:
    """``await make_pool(kinds, size, **settings)``: a started pool, filled; closed at the
    end."""
    pools: list[WarmPool] = []

    async def factory(kinds: tuple[str, ...] = ("python", "exec"), size: int = 1,
                      **overrides: Any) -> WarmPool:
        pool = WarmPool(settings(tmp_path, **overrides), kinds, size)
        pools.append(pool)
        pool.start()
        await pool.filled()
        return pool

    yield factory
    for pool in pools:
        await pool.aclose()


class Box:
    """A sandbox whose runs each get a state socket of their own, as the sandboxed tools'
    runs do (none when ``sandbox_state_scopes`` is empty, or with ``state=False``).

    Attributes:
        store: The state the runs reach.
        sockets: The state socket of each run made, in order.
    """

    def __init__(self, tmp_path: Path, limits: Limits | None = None, **overrides: Any) -> None:
        self.settings = settings(tmp_path, **overrides)
        self.sandbox = Sandbox(self.settings, limits)
        self.store = MemoryStateStore()
        self.sockets: list[StateSocket] = []

    def state_socket(self, run_id: str) -> StateSocket:
        """A state socket serving the run ``run_id``'s state (its tree: its own)."""
        settings = self.settings
        state_socket = StateSocket(
            lambda scope: RunState(self.store, scope, f"{scope}:{run_id}", settings,
                                   writable=True),
            scopes=settings.sandbox_state_scopes, requests_per_second=1000.0,
            max_value_bytes=settings.state_max_value_bytes,
            client_dir=client_dir(sandbox_root(settings), settings.sandbox_python))
        self.sockets.append(state_socket)
        return state_socket

    async def run(self, argv: list[str], *, files: dict[str, str] | None = None,
                  env: dict[str, str] | None = None, run_id: str = "run-a",
                  state: bool = True, pass_fds: tuple[int, ...] = (),
                  on_output: OutputCallback | None = None) -> SandboxResult:
        if not state or not self.settings.sandbox_state_scopes:
            return await self.sandbox.run(argv, files=files, env=env, pass_fds=pass_fds,
                                          on_output=on_output)
        state_socket = self.state_socket(run_id)
        try:
            return await self.sandbox.run(
                argv, files=files, env={**(env or {}), **state_socket.env},
                pass_fds=(*state_socket.pass_fds, *pass_fds),
                read_only_paths=state_socket.read_only_paths, on_output=on_output,
                adopt_state=state_socket.adopt)
        finally:
            await state_socket.aclose()


def box(tmp_path: Path, limits: Limits | None = None, **overrides: Any) -> Box:
    return Box(tmp_path, limits, **overrides)


async def run_python(sandbox: Box, code: str, **options: Any) -> Any:
    python = [sandbox_python(), *PYTHON_FLAGS, "snippet.py"]
    return await sandbox.run(python, files={"snippet.py": code}, env=dict(PYTHON_ENV),
                             **options)


def sandbox_python() -> str:
    return Settings.load().sandbox_python


def held(warm: WarmSandbox) -> dict[int, set[str]]:
    """What each process of ``warm`` holds: its descriptors' numbers and targets."""
    found: dict[int, set[str]] = {}
    for pid in _tree(warm.pid):
        with contextlib.suppress(OSError):
            found[pid] = {f"{fd}={os.readlink(f'/proc/{pid}/fd/{fd}')}"
                          for fd in os.listdir(f"/proc/{pid}/fd")}
    return found


def stopped(pid: int) -> bool:
    """Whether the process ``pid`` is stopped now (its state in /proc)."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()[0] == b"T"


def present(path: Path) -> bool:
    """Whether ``path`` exists (a quick stat)."""
    return os.path.lexists(path)


def gone(warm: WarmSandbox) -> bool:
    """Whether every process of ``warm`` has gone, and its folder too."""
    uid = warm.workdir.uid
    return (not _live_processes(pgid=warm.pid, uid=uid if warm.workdir.own_uid else None)
            and not os.path.lexists(warm.workdir.path))


@pytest.mark.parametrize("scopes", ["run,tree", ""])
async def test_a_run_takes_a_started_sandbox_which_serves_it_alone(make_pool, tmp_path,
                                                                   scopes) -> None:
    # With the state socket on (the default) and off: the launchers differ.
    pool = await make_pool(("exec",), sandbox_state_scopes=scopes)
    [waiting] = pool.waiting("exec")
    handed = metric("handouts", kind="exec")

    result = await box(tmp_path, sandbox_state_scopes=scopes).run(
        ["sh", "-c", "echo hi; ls -A; echo $HOME"])

    assert result.verdict.ok
    assert result.stdout == "hi\n.steer.jsonl\nout\ntmp\n/work\n" or result.isolation != "bwrap"
    assert metric("handouts", kind="exec") == handed + 1
    assert not _live_processes(pgid=waiting.pid)  # nothing of it outlived the run
    await runner.removals()  # its folder goes as the Result goes out
    assert gone(waiting)  # used for exactly one run, destroyed with it
    await pool.filled()  # and replaced in the background by a new one
    [replacement] = pool.waiting("exec")
    assert replacement.pid != waiting.pid
    assert replacement.workdir.path != waiting.workdir.path
    if waiting.workdir.own_uid:  # a uid per run: the next run is someone else
        assert replacement.workdir.uid != waiting.workdir.uid


@pytest.mark.parametrize("scopes", ["run,tree", ""])
@pytest.mark.parametrize("code", [INTROSPECT, "x = (", "import sys\nsys.exit('bye')",
                                  "import os\nos.close(0)\nos.close(1)\nos.close(2)",
                                  "print('no newline at the end', end='')"])
async def test_a_warm_python_run_sees_what_a_cold_one_sees(make_pool, tmp_path, code,
                                                           scopes) -> None:
    cold = await run_python(box(tmp_path, sandbox_state_scopes=scopes), code)
    await make_pool(("python",), sandbox_state_scopes=scopes)
    handed = metric("handouts", kind="python")

    warm = await run_python(box(tmp_path, sandbox_state_scopes=scopes), code)

    assert metric("handouts", kind="python") == handed + 1
    assert (warm.exit_status, warm.verdict) == (cold.exit_status, cold.verdict)
    assert warm.stdout == cold.stdout
    # A traceback names the snippet only, as the interpreter run on it prints it.
    assert warm.stderr == cold.stderr


#: What a shell command can see of its process and folder; equal warm or cold.
SHELL_INTROSPECT = """echo "$0" "$#" "$HOME" "$(pwd)"; ls -A; cat
env | cut -d= -f1 | sort | tr '\\n' ' '; echo
grep -E '^(Sig(Ign|Blk|Cgt)|Groups|NoNewPrivs|Cap...)' /proc/self/status | tr -s '\\t ' ' '
ulimit -a; umask; yes | head -n 2
[ -n "$STARGRPC_STATE_FD" ] && stargrpc-state set k '"v"' && stargrpc-state get k
not-a-command; echo "missing:$?"; exit 3
"""


@pytest.mark.parametrize("scopes", ["run,tree", ""])
async def test_a_warm_shell_run_sees_what_a_cold_one_sees(make_pool, tmp_path,
                                                          scopes) -> None:
    cold = await box(tmp_path, sandbox_state_scopes=scopes).run(["sh", "-c", SHELL_INTROSPECT])
    await make_pool(("exec",), sandbox_state_scopes=scopes)
    handed = metric("handouts", kind="exec")

    warm = await box(tmp_path, sandbox_state_scopes=scopes).run(["sh", "-c", SHELL_INTROSPECT])

    assert metric("handouts", kind="exec") == handed + 1
    assert (warm.exit_status, warm.verdict) == (cold.exit_status, cold.verdict) != (0, None)
    assert warm.stdout == cold.stdout
    assert ("\n\"v\"\n" in warm.stdout) == bool(scopes)  # its own state, when offered
    assert warm.stderr == cold.stderr


#: Snippets whose interpreter's exit does something anyone can see (the launcher ends a
#: warm one with os._exit only when its teardown could show nothing): each must end warm
#: exactly as it ends cold, its output and its files in out/ included.
EXITS = {
    "a file left open, its buffer unflushed": (
        "import os\nleft = open(os.environ['OUTPUT_DIR'] + '/left.txt', 'w')\n"
        "left.write('kept\\n' * 1000)\nraw = open(os.environ['OUTPUT_DIR'] + '/raw', 'wb')\n"
        "raw.write(b'x' * 100)\nprint('done')"),
    "an atexit handler that prints and writes": (
        "import atexit, os\ndef bye():\n    print('bye')\n"
        "    open(os.environ['OUTPUT_DIR'] + '/bye.txt', 'w').write('at exit')\n"
        "atexit.register(bye)\nprint('first')"),
    "an atexit handler that fails": (
        "import atexit\natexit.register(int, 'x')\nprint('first')"),
    "an object with __del__": (
        "class Noisy:\n    def __del__(self):\n        print('deleted')\nkept = Noisy()"),
    "a metaclass with __del__": (
        "class Meta(type):\n    def __del__(cls):\n        print('class gone')\n"
        "class Kept(metaclass=Meta):\n    pass\n"),
    "a class of untracked objects with __del__": (
        "class Noisy(int):\n    __slots__ = ()\n    def __del__(self):\n"
        "        print('deleted', int(self))\nkept = Noisy(7)"),
    "a weak reference's callback": (
        "import weakref\nclass Thing:\n    pass\nthing = Thing()\n"
        "ref = weakref.ref(thing, lambda _: print('gone'))"),
    "a weak proxy's callback": (
        "import weakref\nclass Thing:\n    pass\nthing = Thing()\n"
        "proxy = weakref.proxy(thing, lambda _: print('gone'))"),
    "a suspended generator's finally": (
        "def numbers():\n    try:\n        yield 1\n    finally:\n        print('finally')\n"
        "it = numbers()\nnext(it)"),
    "a gzip file left open": (
        "import gzip, os\nzipped = gzip.GzipFile(os.environ['OUTPUT_DIR'] + '/a.gz', 'wb', "
        "mtime=0)\nzipped.write(b'data' * 100)"),
    "a thread still running": (
        "import threading, time\ndef later():\n    time.sleep(0.2)\n    print('thread')\n"
        "threading.Thread(target=later).start()\nprint('main')"),
    "a daemon thread waiting forever": (
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True)"
        ".start()\nprint('main')"),
    "sys.stdout replaced by a buffered one": (
        "import sys\nsys.stdout = open(1, 'w', closefd=False, buffering=4096)\n"
        "print('buffered')"),
    "warnings shown, a file left open": (
        "import os, warnings\nwarnings.simplefilter('always')\n"
        "left = open(os.environ['OUTPUT_DIR'] + '/w.txt', 'w')\nleft.write('x')"),
    "sys.exit with a status": "import sys\nprint('out')\nsys.exit(3)",
    "sys.exit with a large status": "import sys\nsys.exit(300)",
    "an uncaught exception": "import atexit\natexit.register(print, 'bye')\n1 / 0",
    "killed by a signal": (
        "import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)"),
    "os._exit with a buffer unflushed": (
        "import os\nleft = open(os.environ['OUTPUT_DIR'] + '/lost.txt', 'w')\n"
        "left.write('never flushed')\nos._exit(4)"),
}


@pytest.mark.parametrize("code", list(EXITS.values()), ids=list(EXITS))
async def test_a_warm_python_run_ends_as_a_cold_one_does(make_pool, tmp_path, code) -> None:
    cold = await run_python(box(tmp_path), code)
    await make_pool(("python",))
    handed = metric("handouts", kind="python")

    warm = await run_python(box(tmp_path), code)

    assert metric("handouts", kind="python") == handed + 1
    assert (warm.exit_status, warm.exit_signal, warm.verdict) == (
        cold.exit_status, cold.exit_signal, cold.verdict)
    assert (warm.stdout, warm.stderr) == (cold.stdout, cold.stderr)
    assert [(sent.name, sent.data) for sent in warm.files] == [
        (sent.name, sent.data) for sent in cold.files]


#: A snippet that leaves processes behind, writing to out/ for as long as they live: a
#: forked child, and a daemon (double fork, a session of its own) with stdout closed.
LINGERING = """import os, time
started, wrote = os.pipe()
def write_on(name):
    global wrote
    os.closerange(0, 3)
    with open(os.path.join(os.environ["OUTPUT_DIR"], name), "a") as handle:
        while True:
            handle.write(f"{time.monotonic()}\\n")
            handle.flush()
            if wrote >= 0:
                os.write(wrote, b"w")
                os.close(wrote)
                wrote = -1
if not os.fork():
    write_on("child.txt")
if not os.fork():
    os.setsid()
    if not os.fork():
        write_on("daemon.txt")
    os._exit(0)
os.wait()
os.read(started, 1), os.read(started, 1)
print("parent done")
"""


@pytest.mark.parametrize("code", [
    LINGERING,
    # Its own stdout closed early, it goes on and writes its file last.
    "import os, sys, time\nprint('early', flush=True)\nos.close(1)\nsys.stdout = None\n"
    "time.sleep(0.3)\nopen(os.environ['OUTPUT_DIR'] + '/late.txt', 'w').write('late')",
])
async def test_a_warm_run_returns_only_once_nothing_of_it_is_left(make_pool, tmp_path,
                                                                 code) -> None:
    pool = await make_pool(("python",))
    [waiting] = pool.waiting("python")

    result = await run_python(box(tmp_path), code)

    # At once, not eventually: its Result waited for every process of its sandbox to end
    # (the init of its PID namespace exited), so no write to out/ follows the files read.
    assert not _live_processes(pgid=waiting.pid, uid=waiting.workdir.uid
                               if waiting.workdir.own_uid else None)
    assert result.verdict.ok, result.stderr
    files = {sent.name: sent.data for sent in result.files}
    if code == LINGERING:
        assert result.stdout == "parent done\n"
        assert files.keys() == {"child.txt", "daemon.txt"}  # both wrote before the end
    else:
        assert (result.stdout, files) == ("early\n", {"late.txt": b"late"})
    await runner.removals()
    assert gone(waiting)


async def test_a_warm_run_past_its_wall_clock_is_killed_whole(make_pool, tmp_path) -> None:
    pool = await make_pool(("python",), sandbox_wall_clock_seconds=1)
    [waiting] = pool.waiting("python")
    handed = metric("handouts", kind="python")
    code = "import os, time\nos.fork()\nprint('running', flush=True)\ntime.sleep(60)"

    result = await run_python(box(tmp_path, sandbox_wall_clock_seconds=1), code)

    assert metric("handouts", kind="python") == handed + 1
    assert result.verdict.code == "WALL_CLOCK_LIMIT"
    assert "running" in result.stdout
    assert not _live_processes(pgid=waiting.pid, uid=waiting.workdir.uid
                               if waiting.workdir.own_uid else None)
    await runner.removals()
    assert gone(waiting)


@pytest.mark.parametrize(("code", "at_once"), [
    ("print(1)", True),
    ("import collections, datetime, decimal, json, re, typing\nprint(1)", True),
    ("import os\nleft = open(os.devnull, 'w')\nleft.write('x')", True),
    ("class Noisy:\n    def __del__(self):\n        pass\nkept = Noisy()", False),
    ("class Meta(type):\n    def __del__(cls):\n        pass\n"
     "class Kept(metaclass=Meta):\n    pass\n", False),
    ("import sqlite3", False),
    ("import atexit\natexit.register(int)", False),
])
def test_the_launcher_skips_the_teardown_only_when_it_could_show_nothing(code,
                                                                        at_once) -> None:
    # What the launcher checks after a snippet, run in the sandbox's interpreter: a plain
    # snippet ends at once (the bench's case), anything with a finaliser exits normally.
    python = shutil.which(sandbox_python(), path=SANDBOX_PATH)
    assert python is not None
    check = "import os, sys, _socket\n" + _PY_LEAVE + code + (
        "\nimport atexit\nprint(not atexit._ncallbacks() and _plain_modules()"
        " and _to_flush() is not None)")
    done = subprocess.run([python, *PYTHON_FLAGS, "-c", check], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.splitlines()[-1] == str(at_once)


async def test_a_snippet_with_a_nul_byte_runs_as_it_would_cold(make_pool, tmp_path) -> None:
    # Interpreters differ on a NUL byte in a source file: such a run starts its own.
    cold = await run_python(box(tmp_path), "print(1)\0")
    pool = await make_pool(("python",))
    [waiting] = pool.waiting("python")

    warm = await run_python(box(tmp_path), "print(1)\0")

    assert (warm.exit_status, warm.stdout) == (cold.exit_status, cold.stdout)
    assert pool.waiting("python") == [waiting]


#: Arguments the hand-out must carry exactly: newlines (trailing ones too), backslashes,
#: escapes sh's printf would read, empty ones, spaces, a carriage return, bytes that are
#: not UTF-8.
AWKWARD_ARGUMENTS = ["a\\nb", "", "  spaced  ", "line1\nline2\n\n", "\\", "\\\\n",
                     "%b %s \\c", "tab\there", "\r\n", "\n", os.fsdecode(b"\xff\xfe"),
                     "-c", "--", "$HOME `x` $(y)"]


@pytest.mark.parametrize("scopes", ["run,tree", ""])
async def test_a_warm_run_gets_its_arguments_exactly(make_pool, tmp_path, scopes) -> None:
    command = ["sh", "-c", 'for a; do printf "[%s]" "$a" | od -An -c; done', "sh",
               *AWKWARD_ARGUMENTS]
    cold = await box(tmp_path, sandbox_state_scopes=scopes).run(command)
    await make_pool(("exec",), sandbox_state_scopes=scopes)
    handed = metric("handouts", kind="exec")

    warm = await box(tmp_path, sandbox_state_scopes=scopes).run(command)

    assert metric("handouts", kind="exec") == handed + 1
    assert cold.verdict.ok and cold.stdout.count("[") == len(AWKWARD_ARGUMENTS)
    assert (warm.stdout, warm.stderr, warm.exit_status) == (
        cold.stdout, cold.stderr, cold.exit_status)


async def test_a_warm_python_run_gets_its_arguments_exactly(make_pool, tmp_path) -> None:
    command = [sandbox_python(), *PYTHON_FLAGS, "snippet.py", *AWKWARD_ARGUMENTS]
    files = {"snippet.py": "import os, sys\nprint([os.fsencode(a) for a in sys.argv])"}
    cold = await box(tmp_path).run(command, files=files, env=dict(PYTHON_ENV))
    await make_pool(("python",))
    handed = metric("handouts", kind="python")

    warm = await box(tmp_path).run(command, files=files, env=dict(PYTHON_ENV))

    assert metric("handouts", kind="python") == handed + 1
    assert cold.verdict.ok and str(os.fsencode(AWKWARD_ARGUMENTS[-4])) in cold.stdout
    assert (warm.stdout, warm.stderr) == (cold.stdout, cold.stderr)


async def test_a_run_that_does_not_match_exactly_starts_its_own(make_pool, tmp_path) -> None:
    pool = await make_pool(("exec",))
    [waiting] = pool.waiting("exec")
    handed, missed = metric("handouts", kind="exec"), metric("misses", kind="exec")

    # An extra environment, other limits: the pooled sandbox was started without them.
    with_env = await box(tmp_path).run(["sh", "-c", "echo $EXTRA"], env={"EXTRA": "mine"})
    other_limits = await box(tmp_path, SMALL).run(["sh", "-c", "ulimit -t"])

    # No state socket, or a descriptor besides it: the pooled one was handed neither.
    without_state = await box(tmp_path).run(["sh", "-c", "echo none"], state=False)
    # A state socket that cannot adopt the pooled sandbox's own.
    unadoptable = box(tmp_path)
    own = unadoptable.state_socket("run-a")
    try:
        not_adopting = await unadoptable.sandbox.run(
            ["sh", "-c", "stargrpc-state set k 1 && echo set"], env=own.env,
            pass_fds=own.pass_fds, read_only_paths=own.read_only_paths)
    finally:
        await own.aclose()
    # Arguments longer than sh would read in the time a start takes.
    long_command = await box(tmp_path).run(
        ["sh", "-c", f": {'x' * MAX_SH_HANDOUT_BYTES}; echo long"])
    many_lines = await box(tmp_path).run(
        ["sh", "-c", "\n" * MAX_SH_HANDOUT_LINES + "echo lines"])
    read_end, write_end = os.pipe()
    try:
        other_fd = await box(tmp_path).run(
            ["sh", "-c", f"test -e /proc/self/fd/{write_end} && echo inherited"],
            pass_fds=(write_end,))
    finally:
        os.close(read_end)
        os.close(write_end)

    assert with_env.stdout == "mine\n"
    assert other_limits.stdout == "2\n"  # the soft CPU limit of SMALL
    assert (without_state.stdout, other_fd.stdout) == ("none\n", "inherited\n")
    assert (not_adopting.stdout, long_command.stdout) == ("set\n", "long\n")
    assert many_lines.stdout == "lines\n"
    assert await unadoptable.store.get("run:run-a", "k") == "1"
    assert metric("handouts", kind="exec") == handed
    assert metric("misses", kind="exec") == missed  # not a miss: nothing could serve them
    assert pool.waiting("exec") == [waiting]


async def test_a_pooled_sandbox_that_dies_is_replaced_never_handed_out(make_pool,
                                                                       tmp_path) -> None:
    pool = await make_pool(("exec",))
    [victim] = pool.waiting("exec")
    died = metric("discarded", kind="exec", reason="died")

    os.killpg(victim.pid, signal.SIGKILL)
    await victim.exited  # the pool hears it through the pidfd, before this resumes
    await pool.filled()

    [replacement] = pool.waiting("exec")
    assert replacement.pid != victim.pid
    assert metric("discarded", kind="exec", reason="died") == died + 1
    result = await box(tmp_path).run(["sh", "-c", "echo alive"])
    assert result.stdout == "alive\n"
    assert gone(victim)


@pytest.mark.parametrize("touch", ["file in its folder", "file in out", "steering file",
                                   "folder mode", "stderr written", "process stopped"])
async def test_a_pooled_sandbox_touched_while_waiting_is_never_handed_out(
        make_pool, tmp_path, touch) -> None:
    pool = await make_pool(("exec",))
    [touched] = pool.waiting("exec")
    folder = touched.workdir.path
    tampered = metric("discarded", kind="exec", reason="tampered")
    missed = metric("misses", kind="exec")

    if touch == "file in its folder":
        (folder / "planted.txt").write_text("from someone else")
    elif touch == "file in out":
        (folder / "out" / "planted.txt").write_text("from someone else")
    elif touch == "steering file":
        steer = folder / ".steer.jsonl"
        steer.write_text(steer.read_text() + '{"message": "planted"}\n')
    elif touch == "folder mode":
        folder.chmod(0o777)
    elif touch == "stderr written":
        # Long after it was pooled, when the server reads its stderr already: noted all
        # the same (the server's reader takes the bytes off the pipe as they come).
        stderr = os.open(f"/proc/{touched.pid}/fd/2", os.O_WRONLY)
        os.write(stderr, b"from someone else\n")
        os.close(stderr)
        pipe = touched._leader.proc.stderr
        await eventually(lambda: not select.select([pipe], [], [], 0)[0],
                         what="the bytes taken off the pipe by the server's reader")
    else:
        os.kill(touched.pid, signal.SIGSTOP)
        # The stop lands once the process is next scheduled (later on a busy machine):
        # what the test asks is a sandbox stopped while it waited, before a run came.
        await eventually(lambda: stopped(touched.pid), what="the pooled sandbox stopped")

    result = await box(tmp_path).run(
        ["sh", "-c", "ls -A; ls -A out; cat .steer.jsonl; stat -c %a ."])

    # The touched one was destroyed; the run started its own (the pool had one).
    assert metric("discarded", kind="exec", reason="tampered") == tampered + 1
    assert metric("misses", kind="exec") == missed + 1
    assert result.verdict.ok
    assert "planted" not in result.stdout
    assert result.stdout.splitlines()[-1] == "700"
    assert gone(touched)


async def test_a_burst_beyond_the_pool_starts_the_rest_on_demand(make_pool, tmp_path) -> None:
    pool = await make_pool(("python",), size=1)
    handed, missed = metric("handouts", kind="python"), metric("misses", kind="python")
    code = "import os\nprint(os.getuid(), os.getcwd() if os.getcwd() != '/work' else '')"

    results = await asyncio.gather(*(run_python(box(tmp_path), code) for _ in range(4)))

    assert all(result.verdict.ok for result in results)
    assert metric("handouts", kind="python") - handed >= 1
    assert metric("misses", kind="python") - missed >= 1
    assert (metric("handouts", kind="python") - handed
            + metric("misses", kind="python") - missed) == 4
    # Each run its own user id (when the server is root) and its own folder.
    seen = [result.stdout for result in results]
    if os.geteuid() == 0 and Settings.load().sandbox_uids is not None:
        assert len(set(seen)) == 4
    await pool.filled()


@pytest.mark.parametrize("scopes", ["run,tree", ""])
async def test_a_handed_sandbox_is_over_for_the_refill_once_its_run_has_ended(
        make_pool, tmp_path, monkeypatch, scopes) -> None:
    # The refill waits for the run to end (its folder read and removed), not for its
    # command alone; with the state socket on, the input files are written while the
    # launcher answers the nonce, and are there when the command starts.
    pool = await make_pool(("exec",), sandbox_state_scopes=scopes)
    handed: list[WarmStart] = []

    async def spy(*args: Any, **kwargs: Any) -> WarmStart | None:
        start = await pool.take(*args, **kwargs)
        if start is not None:
            handed.append(start)
        return start

    monkeypatch.setattr(runner, "warm_sources", [spy])
    running = asyncio.Event()

    async def on_output(channel: str, text: str) -> None:
        running.set()

    sandbox = box(tmp_path, sandbox_state_scopes=scopes)
    command = "cat given.txt; while [ ! -e go ]; do sleep 0.01; done; echo done"
    run = asyncio.create_task(sandbox.run(["sh", "-c", command],
                                          files={"given.txt": "given\n"}, state=bool(scopes),
                                          on_output=on_output))
    await running.wait()
    [start] = handed
    assert not start.ended.done()  # its command runs: the run is not over
    (start.workdir.path / "go").touch()
    result = await run

    assert result.verdict.ok, result.stderr_tail
    assert result.stdout == "given\ndone\n"
    await runner.removals()
    assert start.ended.done()
    assert not present(start.workdir.path)
    await pool.filled()


async def test_the_pool_leaves_no_process_or_folder_when_the_server_stops(make_server,
                                                                          ) -> None:
    server = await make_server(sandbox_warm_pool=2)
    assert server.warm_pool is not None
    await server.warm_pool.filled()
    pooled = [*server.warm_pool.waiting("python"), *server.warm_pool.waiting("exec")]
    assert len(pooled) == 4

    await server.stop()

    assert all(gone(warm) for warm in pooled)


async def test_a_server_with_the_pool_off_starts_none(make_server) -> None:
    server = await make_server(sandbox_warm_pool=0)
    assert server.warm_pool is None


def test_the_pool_size_defaults_to_two_per_core(monkeypatch, tmp_path) -> None:
    assert settings(tmp_path).sandbox_warm_pool_size == 2 * (os.cpu_count() or 1)
    monkeypatch.setenv("STARGRPC_SANDBOX_WARM_POOL", "0")
    assert settings(tmp_path).sandbox_warm_pool_size == 0
    monkeypatch.setenv("STARGRPC_SANDBOX_WARM_POOL", "-1")
    with pytest.raises(ValueError, match="sandbox_warm_pool"):
        settings(tmp_path)


def state_socket_of(warm: WarmSandbox) -> str:
    """The socket a pooled sandbox holds as its state socket (``socket:[inode]``)."""
    fd = int(dict(kind_env(warm))["STARGRPC_STATE_FD"])
    [target] = {entry.split("=", 1)[1] for entries in held(warm).values()
                for entry in entries if entry.startswith(f"{fd}=")}
    return target


def kind_env(warm: WarmSandbox) -> dict[str, str]:
    """The environment its launcher was started with."""
    with open(f"/proc/{warm.pid}/environ", "rb") as handle:
        entries = handle.read().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


async def test_a_pooled_sandbox_holds_a_state_socket_of_its_own_served_as_its_runs_state(
        make_pool, tmp_path) -> None:
    # Each pooled sandbox is started with a state socket of its own; nothing serves it
    # while it waits, and the run's state socket adopts it at hand-out: the run's command
    # reaches its run's state through it, and never the state of another run.
    pool = await make_pool(("python",), size=2)
    first, second = pool.waiting("python")
    sandbox = box(tmp_path)
    mine = sandbox.state_socket("run-a")
    runs_own = os.readlink(f"/proc/self/fd/{mine.pass_fds[0]}")  # socket:[inode]
    before = {**held(first), **held(second)}
    owned = state_socket_of(first), state_socket_of(second)
    first_fd = int(kind_env(first)["STARGRPC_STATE_FD"])
    code = ("import json, os, stargrpc_state as s\n"
            "s.state('run').set('mine', 'A')\n"
            "fd = int(os.environ['STARGRPC_STATE_FD'])\n"
            "print(json.dumps([fd, os.fstat(fd).st_ino, s.state('run').keys()]))\n")

    try:
        result = await sandbox.sandbox.run(
            [sandbox_python(), *PYTHON_FLAGS, "snippet.py"], files={"snippet.py": code},
            env={**PYTHON_ENV, **mine.env}, pass_fds=mine.pass_fds,
            read_only_paths=mine.read_only_paths, adopt_state=mine.adopt)
        # Its command has exited: the sandbox's end of the adopted socket is still held
        # by the server, as a run's own is, so the socket shows no end of file (which
        # would wake the loop for it again and again until the run's socket closed).
        assert not select.select([mine._broker], [], [], 0)[0]
    finally:
        await mine.aclose()
    # The next run, handed the other pooled sandbox: its own state only.
    other = await run_python(sandbox, "import stargrpc_state as s\n"
                                      "print(s.state('run').keys(), s.state('tree').keys())",
                             run_id="run-b")

    # While they waited they held no descriptor of the run: their sockets are their
    # control channel (at 0) and a state socket each, of their own.
    entries = [entry for fds in before.values() for entry in fds]
    assert entries and not any(entry.endswith(f"={runs_own}") for entry in entries)
    assert len(set(owned)) == 2 and all(name.startswith("socket:") for name in owned)
    sockets = {entry.split("=", 1)[1] for entry in entries if "socket:" in entry}
    assert sockets - set(owned) == {entry.split("=", 1)[1] for entry in entries
                                    if entry.startswith("0=socket:")}, before
    assert result.verdict.ok, result.stderr
    fd, inode, keys = json.loads(result.stdout)
    assert keys == ["mine"]
    assert f"socket:[{inode}]" == owned[0]  # the first sandbox's own, now the run's
    assert fd == first_fd
    assert other.stdout == "[] []\n"
    assert pool.waiting("python") == [] or second not in pool.waiting("python")
    assert await sandbox.store.get("run:run-a", "mine") == '"A"'
    assert await sandbox.store.get("run:run-b", "mine") is None


#: A launcher that uses its own state socket (a request to set "stolen" in the run's
#: state) at the moment named by its argument — "early": before it says ready (which the
#: hand-out's check sees), "late": once it has the nonce, to which it then answers
#: wrongly — then takes whatever else comes on its control channel until it closes and
#: says what it got.
ROGUE_LAUNCHER = """import array, json, os, socket, sys, time
def use_state():
    broker = socket.socket(fileno=os.dup(int(os.environ["STARGRPC_STATE_FD"])))
    mine, theirs = socket.socketpair()
    broker.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                             array.array("i", [theirs.fileno()]))])
    mine.sendall(b'{"op": "set", "scope": "run", "key": "stolen", "value": 1}\\n')
    return mine
held = [use_state()] if sys.argv[1:] == ["early"] else []
os.write(1, b"ready\\n")
control, taken, got = socket.socket(fileno=0), 0, b""
chunk, fds, _, _ = socket.recv_fds(control, 65536, 4)
taken, got = taken + len(fds), got + chunk
if sys.argv[1:] == ["late"]:
    held.append(use_state())
os.write(1, b"fresh not-the-nonce\\n")
while chunk:
    chunk, fds, _, _ = socket.recv_fds(control, 65536, 4)
    taken, got = taken + len(fds), got + chunk
os.write(1, json.dumps([taken, got.decode()]).encode() + b"\\n")
time.sleep(60)
"""


@pytest.mark.parametrize("rogue_uses_its_state", ["early", "late"])
async def test_a_sandbox_that_fails_the_hand_out_is_never_served_as_the_run(
        tmp_path, rogue_uses_its_state) -> None:
    # One that used its state socket while it waited fails the check and is given
    # nothing (not the nonce, nor the run's files); one that answers the nonce wrongly
    # has its state socket never adopted: what it sent there is never served as the run's.
    sandbox = box(tmp_path)
    state_socket = sandbox.state_socket("run-a")
    [kind] = [kind for kind in kinds_for(sandbox.settings).values() if kind.name == "exec"]
    rogue = replace(kind, launcher=(sandbox_python(), "-I", "-c", ROGUE_LAUNCHER,
                                    rogue_uses_its_state))
    warm = await WarmSandbox.start(sandbox.sandbox, rogue)
    why = "state socket was used" if rogue_uses_its_state == "early" else "wrongly"
    adopted: list[object] = []
    try:
        if rogue_uses_its_state == "early":  # (sent before it said ready)
            assert "state socket" in (warm.unfit() or "")
        with pytest.raises(Unfit, match=why):
            await warm.hand_out(encode_arguments(["sh", "-c", "echo the-secret-command"]),
                                {"input.txt": "the-secret-file"}, sandbox.sandbox.limits,
                                lambda *ends: adopted.append(ends))
        assert warm._stdout is not None
        if rogue_uses_its_state == "early":  # given up before anything was sent
            assert not (warm.workdir.path / "input.txt").exists()
            assert await warm._stdout.readline() == b"fresh not-the-nonce\n"
        taken, got = json.loads(await warm._stdout.readline())  # the channel closed on it
    finally:
        await warm.aclose()
        await state_socket.aclose()
    assert adopted == []  # its state socket never became the run's
    assert await sandbox.store.get("run:run-a", "stolen") is None
    assert taken == 0
    if rogue_uses_its_state == "early":
        assert got == ""
    else:
        assert got.split("\n", 1)[1].startswith("3\n1\nsh\n1\n-c\n")  # the nonce first
    assert gone(warm)


async def test_a_sandbox_whose_state_socket_cannot_be_adopted_is_destroyed_not_left(
        tmp_path) -> None:
    # The adoption fails after the sandbox answered the nonce (the run's state socket could
    # not take it over): it belongs to no run, so closing it must still end it and remove
    # its folder, rather than leave it running as if a run had it.
    sandbox = box(tmp_path)
    [kind] = [kind for kind in kinds_for(sandbox.settings).values() if kind.name == "exec"]
    warm = await WarmSandbox.start(sandbox.sandbox, kind)

    def refuse(*ends: object) -> None:
        raise OSError("the run's state socket could not take it")

    try:
        with pytest.raises(OSError, match="could not take it"):
            await warm.hand_out(encode_arguments(["sh", "-c", "sleep 60"]), {},
                                sandbox.sandbox.limits, refuse)
    finally:
        await warm.aclose()
    assert gone(warm)


async def test_the_python_tool_takes_a_warm_sandbox_end_to_end(make_server) -> None:
    # With the default state scopes: the pooled sandbox is handed the run's state socket.
    server = await make_server(sandbox_warm_pool=1)
    await server.warm_pool.filled()
    handed = metric("handouts", kind="python")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "python", {"code": "print(6 * 7)"})
        # Hostile snippets through the pool: the server keeps serving after each.
        for code in ("x = 1\0", "import os; os.close(0); os.close(1)",
                     "import os; os.kill(os.getppid(), 9)"):
            hostile = await run_tool(stub, "python", {"code": code})
            assert hostile[-1].HasField("result")
        again = await run_tool(stub, "python", {"code": "print('still')"})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert result.output.startswith("42\n")
    assert as_dict(result)["structured_output"]["exit_status"] == 0
    assert metric("handouts", kind="python") >= handed + 1
    assert again[-1].result.output.startswith("still\n")


async def test_warm_tool_runs_reach_their_own_state_and_not_each_others(make_server) -> None:
    server = await make_server(sandbox_warm_pool=2)
    await server.warm_pool.filled()
    python, shell = metric("handouts", kind="python"), metric("handouts", kind="exec")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        first = await run_tool(stub, "python", {"code": (
            "import os, stargrpc_state as s\n"
            "s.state('run').set('secret', 'A'); s.state('tree').set('secret', 'A')\n"
            "print(os.environ['STARGRPC_STATE_FD'], s.state('run').keys())")})
        second = await run_tool(stub, "python", {"code": (
            "import os, stargrpc_state as s\n"
            "print(os.environ['STARGRPC_STATE_FD'], s.state('run').keys(), "
            "s.state('tree').keys())")})
        shell_run = await run_tool(stub, "shell", {"command": (
            "echo $STARGRPC_STATE_FD; stargrpc-state get secret; echo absent:$?; "
            "stargrpc-state set k '[1]' && stargrpc-state get k && stargrpc-state keys")})

    assert first[-1].result.output.split(" ", 1)[1].startswith("['secret']\n")
    assert second[-1].result.output.split(" ", 1)[1].startswith("[] []\n")
    assert shell_run[-1].result.outcome == events_pb2.OUTCOME_OK, shell_run[-1].result.output
    assert shell_run[-1].result.output.split("\n", 1)[1].startswith("absent:3\n[1]\nk\n")
    # Every run was handed a pooled sandbox (the handouts say so).
    assert metric("handouts", kind="python") == python + 2
    assert metric("handouts", kind="exec") == shell + 1
    store = server.runtime.state_store
    assert await store.get(f"run:{first[0].run_id}", "secret") == '"A"'


async def test_a_server_holding_many_descriptors_still_hands_out_and_ends_runs(
        make_pool, tmp_path) -> None:
    # A server with many connections numbers its new descriptors past 1023, where select()
    # refuses them: the hand-out's checks and the run's end must not use it.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.fail(f"this test needs an open-file limit of 1400 or more (hard: {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        pool = await make_pool(("exec",))
        [waiting] = pool.waiting("exec")
        stderr = waiting._leader.proc.stderr
        assert stderr is not None and stderr.fileno() >= 1024
        handed = metric("handouts", kind="exec")

        result = await box(tmp_path).run(["sh", "-c", "echo hi"])

        assert result.verdict.ok and result.stdout == "hi\n"
        assert metric("handouts", kind="exec") == handed + 1
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
