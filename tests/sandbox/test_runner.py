"""The sandbox runner on its own: streaming, caps, scrubbed environment, isolation, kill."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from stargrpc.sandbox import Limits, Sandbox, isolation_for, runner
from stargrpc.sandbox.runner import (
    _INLINE_BYTES,
    _INLINE_ENTRIES,
    _entries_within,
    _few_entries,
    _live_processes,
    _read_proc,
    removals,
)
from stargrpc.settings import MiB, Settings
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import eventually, run_tool
from tests.sandbox.proctable import marker, wait_until_gone, wait_until_running

SMALL = Limits(cpu_seconds=2, memory_bytes=256 * MiB, file_size_bytes=16 * MiB,
               max_processes=32, wall_clock_seconds=10, output_bytes=64 * 1024)


def exists(path: str | Path) -> bool:
    """Whether a path exists (a quick stat; fine inside a test's event loop)."""
    return os.path.lexists(path)


def settings(tmp_path: Path, **overrides: Any) -> Settings:
    return Settings.load(state_dir=tmp_path / "state", **overrides)


def sandbox(tmp_path: Path, limits: Limits = SMALL, **overrides: Any) -> Sandbox:
    return Sandbox(settings(tmp_path, **overrides), limits)


class Recorder:
    """Collects (channel, text) as the runner streams it."""

    def __init__(self) -> None:
        self.pieces: list[tuple[str, str]] = []
        self.first = asyncio.Event()

    async def __call__(self, channel: str, text: str) -> None:
        self.pieces.append((channel, text))
        self.first.set()

    def text(self, channel: str) -> str:
        return "".join(t for c, t in self.pieces if c == channel)


def sleeper(token: str) -> str:
    """A shell command for a process that sleeps long, with ``token`` on its command line
    and SIGTERM ignored."""
    return (f"python3 -I -c 'import signal, time; signal.signal(signal.SIGTERM, "
            f"signal.SIG_IGN); time.sleep(600)' {token}")


bwrap_only = pytest.mark.skipif(
    isolation_for(Settings.load()).mode != "bwrap",
    reason="bubblewrap isolation is not available on this machine")


async def test_streams_stdout_and_stderr_apart_and_returns_output_files(tmp_path) -> None:
    out = Recorder()
    result = await sandbox(tmp_path).run(
        ["sh", "-c", "echo one; echo oops >&2; echo two; printf 'a,b\\n' > $OUTPUT_DIR/t.csv"],
        on_output=out)

    assert result.verdict.ok
    assert out.text("stdout") == "one\ntwo\n"
    assert out.text("stderr") == "oops\n"
    assert [(f.name, f.data, f.mime_type) for f in result.files] == [
        ("t.csv", b"a,b\n", "text/csv")]


async def test_workdir_is_fresh_and_removed_afterwards(tmp_path) -> None:
    box = sandbox(tmp_path, sandbox_isolation="rlimits")  # shows the real path
    first = await box.run(["sh", "-c", "touch left-behind; pwd"])
    second = await box.run(["sh", "-c", "ls -A"])
    await removals()  # a small folder goes a moment after its run returned

    workdir = Path(first.stdout_tail.strip())
    assert workdir.name.startswith("run-")
    assert not exists(workdir)
    assert sorted(second.stdout_tail.split()) == [".steer.jsonl", "out", "tmp"]


async def test_environment_is_scrubbed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STARGRPC_TEST_SECRET", "s3cr3t-value")
    monkeypatch.setenv("TZ", "UTC")
    result = await sandbox(tmp_path).run(
        ["sh", "-c", f"env; cat /proc/{os.getpid()}/environ; cat /proc/$PPID/environ; true"])

    assert "s3cr3t-value" not in result.stdout_tail
    assert "s3cr3t-value" not in result.stderr_tail
    assert "TZ=UTC" in result.stdout_tail  # allowlisted by default
    assert "OUTPUT_DIR=" in result.stdout_tail


async def test_output_past_the_cap_is_cut_with_a_marker(tmp_path) -> None:
    out = Recorder()
    limits = Limits(cpu_seconds=5, wall_clock_seconds=20, output_bytes=4096)
    result = await sandbox(tmp_path, limits).run(
        ["sh", "-c", "i=0; while [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done; echo done"],
        on_output=out)

    shown = out.text("stdout")
    assert result.verdict.ok
    assert result.output_truncated
    assert shown.endswith("[output truncated: more than 4096 bytes; the rest was discarded]\n")
    assert len(shown.encode()) < 4096 + 200
    assert result.stdout_tail.endswith("done\n")  # the tail still saw the end


async def test_wall_clock_kills_a_process_that_ignores_sigterm(tmp_path) -> None:
    token = marker()
    limits = Limits(cpu_seconds=5, wall_clock_seconds=1.5)
    result = await sandbox(tmp_path, limits).run(
        ["sh", "-c", f"trap '' TERM; {sleeper(token)} & wait"])

    assert result.verdict.code == "WALL_CLOCK_LIMIT"
    assert result.verdict.message == "killed: wall-clock limit of 1.5 s exceeded"
    assert await wait_until_gone(token) == []


@pytest.mark.parametrize("mode", ["rlimits", "unshare", "bwrap"])
async def test_cancellation_kills_the_whole_group(tmp_path, mode) -> None:
    try:
        box = sandbox(tmp_path, sandbox_isolation=mode)
    except RuntimeError:
        pytest.skip(f"{mode} isolation does not work here")
    token = marker()
    out = Recorder()
    task = asyncio.create_task(box.run(
        ["sh", "-c", f"{sleeper(token)} & {sleeper(token)} & echo started; wait"],
        on_output=out))
    await asyncio.wait_for(out.first.wait(), 30)
    assert await wait_until_running(token)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_until_gone(token) == []
    assert box.isolation.mode == mode


@bwrap_only
async def test_bwrap_has_no_network_and_a_read_only_system(tmp_path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    host_marker = Path("/tmp") / f"escape-{marker()}"
    try:
        result = await sandbox(tmp_path).run(["sh", "-c", (
            f"echo x > /etc/owned; echo x > {host_marker}; ls /root /home; "
            f"python3 -I -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\""
        )])
    finally:
        listener.close()

    assert "Read-only file system" in result.stderr_tail  # /etc
    assert not exists(host_marker)  # /tmp is private
    assert not exists("/etc/owned")
    assert "ConnectionRefusedError" in result.stderr_tail  # its own empty loopback
    assert result.isolation == "bwrap"


async def test_rlimits_mode_says_what_it_is(tmp_path) -> None:
    box = sandbox(tmp_path, sandbox_isolation="rlimits")
    result = await box.run(["sh", "-c", "echo ok"])

    assert result.stdout_tail == "ok\n"
    assert "NO network or file-system isolation" in box.isolation.description


async def test_symlinks_in_the_output_folder_are_not_followed(tmp_path) -> None:
    secret = tmp_path / "server-secret.txt"
    secret.write_text("do not send")
    result = await sandbox(tmp_path, sandbox_isolation="rlimits").run(
        ["sh", "-c", f"ln -s {secret} $OUTPUT_DIR/link.txt; echo fine > $OUTPUT_DIR/ok.txt"])

    assert [f.name for f in result.files] == ["ok.txt"]
    assert result.skipped_files == ["link.txt: not a plain file"]


@pytest.mark.parametrize("files", [2, _INLINE_ENTRIES + 8])
async def test_a_few_output_files_or_many_come_back_and_the_folder_goes(tmp_path,
                                                                         files) -> None:
    # A folder left with a few entries is read and removed on the event loop, one with
    # more in a thread: the same files come back, and nothing is left either way.
    seen: list[str] = []
    command = (f"i=0; while [ $i -lt {files} ]; do echo $i > $OUTPUT_DIR/f$i.txt; "
               "i=$((i+1)); done; mkdir $OUTPUT_DIR/sub; echo deep > $OUTPUT_DIR/sub/d.txt; "
               "pwd >&2")

    async def on_output(channel: str, text: str) -> None:
        seen.append(text)

    box = sandbox(tmp_path, sandbox_isolation="rlimits")
    result = await box.run(["sh", "-c", command], on_output=on_output)

    assert result.verdict.ok, result.stderr_tail
    assert sorted(f.name for f in result.files) == sorted(
        [f"f{i}.txt" for i in range(files)] + ["sub/d.txt"])
    assert result.bytes_written is not None and result.bytes_written > 0
    await removals()  # a small folder goes as the Result goes out, a large one before
    assert not exists("".join(seen).strip())


async def test_a_small_folders_removal_waits_a_moment_and_removals_begins_it_at_once(
        tmp_path, monkeypatch) -> None:
    # The removal waits for the run's last events and Result to go out first; a server
    # stopping (or anyone awaiting removals()) does not wait for that moment.
    monkeypatch.setattr(runner, "_REMOVAL_DELAY_SECONDS", 3600.0)
    box = sandbox(tmp_path, sandbox_isolation="rlimits")
    result = await box.run(["sh", "-c", "pwd; echo kept > $OUTPUT_DIR/a.txt"])
    folder = result.stdout.strip()

    assert [f.name for f in result.files] == ["a.txt"]
    assert exists(folder)  # returned, its folder still there for a moment
    await asyncio.wait_for(removals(), 30)
    assert not exists(folder)


async def test_in_a_burst_only_one_removal_waits_its_moment(tmp_path, monkeypatch) -> None:
    # Each waiting removal holds an executor thread that every to_thread call of the server
    # shares: while one waits, the folders of the runs ending after it go at once.
    monkeypatch.setattr(runner, "_REMOVAL_DELAY_SECONDS", 3600.0)
    box = sandbox(tmp_path, sandbox_isolation="rlimits")
    first, second, third = [await box.run(["sh", "-c", "pwd"]) for _ in range(3)]
    folders = [result.stdout.strip() for result in (first, second, third)]

    await eventually(lambda: not exists(folders[1]) and not exists(folders[2]),
                     what="the burst's later folders removed")
    assert exists(folders[0])  # the first still waits its moment
    await asyncio.wait_for(removals(), 30)
    assert not exists(folders[0])


def test_a_run_in_an_event_loop_of_its_own_leaves_no_folder_once_the_loop_is_done(
        tmp_path) -> None:
    # An embedder's asyncio.run: its small folder's removal, still waiting out its delay
    # as the run returns, is over before asyncio.run returns (it waits in an executor
    # thread, which asyncio.run waits for).
    box = sandbox(tmp_path, sandbox_isolation="rlimits")
    result = asyncio.run(box.run(["sh", "-c", "pwd"]))

    assert result.verdict.ok, result.stderr_tail
    assert not exists(result.stdout.strip())


async def test_a_server_stopping_removes_its_last_runs_folder_at_once(
        make_server, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(runner, "_REMOVAL_DELAY_SECONDS", 3600.0)
    server = await make_server(sandbox_isolation="rlimits")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "shell",
                                {"command": "pwd"})
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result
    folder = result.output.splitlines()[0]
    assert exists(folder)

    await asyncio.wait_for(server.stop(), 30)

    assert not exists(folder)


async def test_an_output_file_whose_name_is_not_utf8_is_skipped_and_told(tmp_path) -> None:
    # A sent file's name is text: one made of bytes that are not UTF-8 (a folder's too) is
    # told skipped, escaped, instead of failing the run's end.
    result = await sandbox(tmp_path, sandbox_isolation="rlimits").run(
        ["sh", "-c", "cd $OUTPUT_DIR; echo a > \"$(printf 'bad\\377.txt')\"; "
                     "mkdir \"$(printf 'dir\\376')\"; echo b > good.txt"])

    assert result.verdict.ok, result.stderr_tail
    assert [f.name for f in result.files] == ["good.txt"]
    assert sorted(result.skipped_files) == ["bad\\xff.txt: the name is not UTF-8",
                                            "dir\\xfe: the name is not UTF-8"]


def test_counting_a_folder_stops_past_its_budget_and_follows_no_link(tmp_path) -> None:
    folder = tmp_path / "run"
    (folder / "out" / "deep").mkdir(parents=True)
    (folder / "out" / "deep" / "a.txt").write_text("a")
    big = tmp_path / "big"
    big.mkdir()
    for i in range(50):
        (big / str(i)).write_text("x")
    (folder / "out" / "link").symlink_to(big)  # counted as one entry, never entered
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert _entries_within(fd, 10) == 10 - 4  # out, deep, a.txt, link
        assert _entries_within(fd, 4) == 0
        assert _entries_within(fd, 3) < 0
        (folder / "out" / "deep").chmod(0)
        if os.geteuid() != 0:  # a folder it cannot list: not a few entries
            assert _entries_within(fd, 10) < 0
    finally:
        (folder / "out" / "deep").chmod(0o755)
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a sandbox user to fail the probe")
async def test_a_mode_that_does_not_work_is_refused_not_weakened(make_server, tmp_path) -> None:
    # bubblewrap, running as the sandbox user, cannot reach a root directory inside the
    # test's private (0700) temporary folder, so the explicit bwrap mode fails its probe.
    server = await make_server(sandbox_isolation="bwrap", sandbox_root=tmp_path / "box")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "python",
                                {"code": "print(1)"})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert result.error.code == "SANDBOX_UNAVAILABLE"
    assert "'bwrap' does not work on this machine" in result.error.message


def test_a_sandbox_root_planted_as_a_symlink_is_refused(tmp_path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root").symlink_to(tmp_path / "elsewhere")

    with pytest.raises(RuntimeError, match="is not a directory owned by the server's user"):
        sandbox(tmp_path, sandbox_root=tmp_path / "root")


async def test_a_spawned_server_talks_over_stdio_and_its_whole_group_goes_at_close(
        tmp_path) -> None:
    token = marker()
    box = sandbox(tmp_path, sandbox_isolation="rlimits")  # shows the real path
    process = await box.spawn(["sh", "-c", f"pwd; {sleeper(token)} & exec cat"])
    try:
        workdir = Path((await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip())
        process.stdin.write(b"ping\n")
        assert await asyncio.wait_for(process.stdout.readline(), 30) == b"ping\n"
        assert await wait_until_running(token)
        assert not process.exited.done()
    finally:
        status = await process.aclose()

    assert status is not None and os.WIFSIGNALED(status)  # killed at close
    assert await process.aclose() is None  # a second close does nothing
    assert await wait_until_gone(token) == []
    assert workdir.name.startswith("run-")
    assert not exists(workdir)


async def test_a_spawned_server_past_the_disk_cap_is_stopped(tmp_path) -> None:
    limits = Limits(cpu_seconds=5, file_size_bytes=16 * MiB, disk_bytes=4 * MiB)
    process = await sandbox(tmp_path, limits).spawn(
        ["sh", "-c", "head -c 8000000 /dev/zero > big; exec sleep 600"])
    try:
        await asyncio.wait_for(asyncio.shield(process.exited), 30)
        assert process.stopped is not None
        assert process.stopped.code == "DISK_LIMIT"
        assert process.describe_exit() == "it was stopped: stopped: disk limit of 4 MB exceeded"
    finally:
        await process.aclose()


async def test_one_pass_over_proc_finds_a_group_and_a_user() -> None:
    group = await asyncio.create_subprocess_exec(
        "sleep", "600", start_new_session=True)
    other = await asyncio.create_subprocess_exec(
        "sleep", "600", user=65533 if os.geteuid() == 0 else None)
    # A process whose saved uid alone is 65533 (root may set it so): it could take that uid
    # back at any time, so it counts as running as it.
    saved = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import os, sys, time\n"
        "if os.geteuid() == 0: os.setresuid(0, 0, 65533)\n"
        "print(flush=True); time.sleep(600)", stdout=asyncio.subprocess.PIPE)
    # A zombie of that uid (exited, not yet reaped) runs nothing: not counted.
    # (Popen: asyncio's child watcher reaps its children at once.)
    zombie = subprocess.Popen(["true"],  # noqa: ASYNC220 (spawns only; reaped below)
                              user=65533 if os.geteuid() == 0 else None)
    try:
        assert saved.stdout is not None and await saved.stdout.readline() == b"\n"
        await eventually(lambda: _read_proc(f"/proc/{zombie.pid}/stat").rsplit(
            b")", 1)[1].split()[0] == b"Z")
        assert _live_processes(pgid=group.pid) == [group.pid]
        if os.geteuid() == 0:
            assert sorted(_live_processes(uid=65533)) == sorted([other.pid, saved.pid])
            assert sorted(_live_processes(pgid=group.pid, uid=65533)) == sorted(
                [group.pid, other.pid, saved.pid])
    finally:
        for proc in (group, other, saved):
            proc.kill()
            await proc.wait()
        zombie.wait()
    assert _live_processes(pgid=group.pid) == []


def test_a_folder_of_few_but_large_files_is_not_counted_as_few(tmp_path) -> None:
    # Reading a run's output files and removing its folder on the event loop is for small
    # folders only: sixteen files of a few MiB each would stall every call meanwhile.
    folder = tmp_path / "run"
    (folder / "out").mkdir(parents=True)
    (folder / "out" / "small.txt").write_bytes(b"x" * 1000)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert _entries_within(fd, 10, [2000]) == 10 - 2
        assert _entries_within(fd, 10, [999]) < 0
        (folder / "out" / "large.bin").write_bytes(b"x" * (_INLINE_BYTES + 1))
        assert not _few_entries(fd)
        (folder / "out" / "large.bin").unlink()
        assert _few_entries(fd)
    finally:
        os.close(fd)
