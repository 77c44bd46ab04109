"""A run or a spawn cancelled at any point of its start leaves no process and no folder.

The task is cancelled after k turns of the event loop, for each k, so the cancellation
lands in each await of the start in turn (the pipes being connected, the first wait…).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from stargrpc.sandbox import Limits, Sandbox
from stargrpc.sandbox.runner import SandboxProcess, _Workdir
from stargrpc.settings import MiB, Settings
from tests.sandbox.proctable import marker, wait_until_gone

LIMITS = Limits(cpu_seconds=2, memory_bytes=256 * MiB, file_size_bytes=16 * MiB,
                max_processes=32, wall_clock_seconds=30, output_bytes=64 * 1024)
TURNS = range(9)
#: rlimits starts the command at once (its cwd is set before the exec that Popen waits
#: for); bubblewrap may still be setting up and give up when the folder goes early.
MODES = ["rlimits", "bwrap"]


def sandbox(tmp_path: Path, mode: str) -> tuple[Sandbox, list[Path]]:
    """A sandbox, and the working directories it makes (recorded as they are made)."""
    try:
        box = Sandbox(Settings.load(state_dir=tmp_path / "state", sandbox_isolation=mode),
                      LIMITS)
    except RuntimeError:
        pytest.skip(f"{mode} isolation does not work here")
    made: list[Path] = []
    make = box._make_workdir

    def recording(files: Any) -> _Workdir:
        workdir = make(files)
        made.append(workdir.path)
        return workdir

    box._make_workdir = recording  # type: ignore[method-assign]
    return box, made


def sleeper(token: str) -> list[str]:
    """A command that runs long, with ``token`` on its command line from the start (the
    isolation wrapper's carries it too)."""
    return ["python3", "-I", "-c", "import time; time.sleep(600)", token]


async def cancel_after(task: asyncio.Task[Any], turns: int) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()


def left_behind(folders: list[Path]) -> list[Path]:
    """The folders that still exist (a quick stat each; fine inside the event loop)."""
    return [path for path in folders if os.path.lexists(path)]


def reaped(pid: int) -> bool:
    """Whether ``pid`` is no child of ours any more (reaped, not a zombie left over)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


async def assert_nothing_left(token: str, made: list[Path]) -> None:
    left = await wait_until_gone(token)
    for pid in left:  # do not leave them running when the test fails
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == []
    assert left_behind(made) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("turns", TURNS)
async def test_a_run_cancelled_while_it_starts_leaves_nothing(tmp_path, turns,
                                                                 mode) -> None:
    box, made = sandbox(tmp_path, mode)
    token = marker()
    task = asyncio.create_task(box.run(sleeper(token)))
    await cancel_after(task, turns)
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_nothing_left(token, made)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("turns", TURNS)
async def test_a_spawn_cancelled_while_it_starts_leaves_nothing(tmp_path, turns,
                                                                 mode) -> None:
    box, made = sandbox(tmp_path, mode)
    token = marker()
    task = asyncio.create_task(box.spawn(sleeper(token)))
    await cancel_after(task, turns)
    process: SandboxProcess | None = None
    with contextlib.suppress(asyncio.CancelledError):
        process = await task
    if process is not None:  # it was started before the cancellation landed
        await process.aclose()
    await assert_nothing_left(token, made)


@pytest.mark.parametrize("kind", ["run", "spawn"])
async def test_a_leader_that_cannot_be_watched_is_killed_and_reaped(tmp_path, kind,
                                                                    monkeypatch) -> None:
    box, made = sandbox(tmp_path, "rlimits")
    token = marker()
    started: list[int] = []

    def no_pidfd(pid: int, flags: int = 0) -> int:
        started.append(pid)
        raise OSError(24, "Too many open files")  # as when the server is out of fds

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    with pytest.raises(OSError, match="Too many open files"):
        await (box.run if kind == "run" else box.spawn)(sleeper(token))
    monkeypatch.undo()

    assert len(started) == 1
    await assert_nothing_left(token, made)
    assert reaped(started[0])
