"""The sandbox's file-system boundary, attacked from inside a run: a swapped output folder,
links, FIFOs, deep nesting, disk use, and one run reaching for another's files."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

from stargrpc.cli import main
from stargrpc.sandbox import Limits, Sandbox
from stargrpc.sandbox.runner import sandbox_root
from stargrpc.settings import MiB, Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, run_tool

LIMITS = {"sandbox_cpu_seconds": 5, "sandbox_memory_mb": 256, "sandbox_file_size_mb": 16,
          "sandbox_wall_clock_seconds": 60}
MODES = ["bwrap", "unshare", "rlimits"]


def sandbox(tmp_path: Path, mode: str = "auto", **overrides: Any) -> Sandbox:
    """A runner in ``mode``; skips the test when the mode does not work here."""
    settings = Settings.load(state_dir=tmp_path / "state", sandbox_isolation=mode, **overrides)
    try:
        return Sandbox(settings, Limits(cpu_seconds=5, memory_bytes=256 * MiB,
                                        file_size_bytes=16 * MiB, wall_clock_seconds=30,
                                        disk_bytes=settings.sandbox_disk_mb * MiB))
    except RuntimeError:
        pytest.skip(f"{mode} isolation does not work here")


@pytest.fixture
async def served(make_server: Any, tmp_path: Path) -> AsyncIterator[
        tool_service_pb2_grpc.ToolServiceStub]:
    server = await make_server(**LIMITS)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


class LiveRun:
    """A python run kept running (it printed ``ready``) until :meth:`stop`."""

    def __init__(self, stub: tool_service_pb2_grpc.ToolServiceStub, code: str) -> None:
        self.call = stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="python", arguments_json=json.dumps({"code": code})))
        self.printed = ""

    async def started(self) -> None:
        async for response in self.call:
            self.printed += response.event.step.delta
            if "ready\n" in self.printed:
                return
        raise AssertionError(f"the live run ended first: {self.printed!r}")

    def stop(self) -> None:
        self.call.cancel()


LIVE_CODE = ("import os, time\n"
             "open(os.path.join(os.environ['OUTPUT_DIR'], 'a-secret.txt'), 'w')"
             ".write('SECRET-OF-A')\n"
             "open('a-input.txt', 'w').write('SECRET-OF-A')\n"
             "print('ready', flush=True)\ntime.sleep(60)\n")


def swap_out(target: str) -> str:
    """Python code that replaces its output folder by a symlink to ``target``."""
    return ("import os, shutil\nout = os.environ['OUTPUT_DIR']\nshutil.rmtree(out)\n"
            f"os.symlink({target!r}, out)\n")


def everything_said(result: events_pb2.Result) -> str:
    """All a caller learns from a Result, as text."""
    return json.dumps(as_dict(result)) + "".join(f.name for f in result.writeback.sent_files)


NOT_A_FOLDER = "out: not a plain folder of the run; no file returned"


async def test_an_output_folder_swapped_for_the_sandbox_root_returns_nothing_of_another_run(
        served: tool_service_pb2_grpc.ToolServiceStub) -> None:
    live = LiveRun(served, LIVE_CODE)
    try:
        await asyncio.wait_for(live.started(), 60)
        root = str(sandbox_root(Settings.load()))
        events = await run_tool(served, "python", {"code": swap_out(root)})
    finally:
        live.stop()

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert list(result.writeback.sent_files) == []
    assert as_dict(result)["structured_output"]["skipped_files"] == [NOT_A_FOLDER]
    for leak in ("SECRET-OF-A", "a-secret", "a-input", "snippet.py", "run-"):
        assert leak not in everything_said(result)


async def test_an_output_folder_swapped_for_the_state_dir_reveals_nothing_and_audit_holds(
        served: tool_service_pb2_grpc.ToolServiceStub, tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "keys.json").write_text('{"keys": "KEYS-FILE-CONTENT"}')
    await run_tool(served, "echo", {"text": "first"})  # the audit database exists
    events = await run_tool(served, "python", {"code": swap_out(str(state))})
    after = await run_tool(served, "echo", {"text": "still audited"})

    result = events[-1].result
    assert list(result.writeback.sent_files) == []
    assert as_dict(result)["structured_output"]["skipped_files"] == [NOT_A_FOLDER]
    for leak in ("KEYS-FILE-CONTENT", "keys.json", "audit.db"):
        assert leak not in everything_said(result)
    assert after[-1].result.output == "still audited"
    verified = await asyncio.to_thread(CliRunner().invoke, main, [
        "audit", "verify", "--store", f"sqlite:///{state / 'audit.db'}"])
    assert verified.exit_code == 0, verified.output
    assert verified.output.startswith("ok: 3 records, chain intact")


@pytest.mark.parametrize("target", ["/", "/etc", "/proc/self/cwd"])
async def test_symlinks_to_folders_inside_the_output_folder_are_not_entered(
        served: tool_service_pb2_grpc.ToolServiceStub, target: str) -> None:
    code = ("import os\nout = os.environ['OUTPUT_DIR']\n"
            f"os.symlink({target!r}, os.path.join(out, 'elsewhere'))\n"
            "open(os.path.join(out, 'ok.txt'), 'w').write('fine')\n")
    events = await run_tool(served, "python", {"code": code})

    result = events[-1].result
    assert [f.name for f in result.writeback.sent_files] == ["ok.txt"]
    assert as_dict(result)["structured_output"]["skipped_files"] == [
        "elsewhere: not a plain file"]


@pytest.mark.parametrize("planted", [
    "os.rmdir(out); os.mkfifo(out)",
    "os.rmdir(out); open(out, 'w').write('a file')",
    "os.rmdir(out); os.symlink('/dev/zero', out)",
])
async def test_an_output_folder_that_is_not_a_folder_is_refused_at_once(
        served: tool_service_pb2_grpc.ToolServiceStub, planted: str) -> None:
    code = f"import os\nout = os.environ['OUTPUT_DIR']\n{planted}\n"
    events = await asyncio.wait_for(run_tool(served, "python", {"code": code}), 30)

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert as_dict(result)["structured_output"]["skipped_files"] == [NOT_A_FOLDER]


async def test_fifos_devices_and_hard_links_in_the_output_folder_are_skipped(
        served: tool_service_pb2_grpc.ToolServiceStub) -> None:
    code = ("import os\nout = os.environ['OUTPUT_DIR']\n"
            "os.mkfifo(os.path.join(out, 'pipe'))\n"
            "open('kept.txt', 'w').write('x')\nos.link('kept.txt', os.path.join(out, 'hard'))\n"
            "os.makedirs(os.path.join(out, 'sub'))\n"
            "open(os.path.join(out, 'sub', 'deep.txt'), 'w').write('deep')\n")
    events = await asyncio.wait_for(run_tool(served, "python", {"code": code}), 30)

    result = events[-1].result
    assert [(f.name, f.content) for f in result.writeback.sent_files] == [
        ("sub/deep.txt", b"deep")]
    assert sorted(as_dict(result)["structured_output"]["skipped_files"]) == [
        "hard: not a plain file", "pipe: not a plain file"]


async def test_a_file_deeper_than_the_walk_goes_is_told_not_dropped_silently(
        served: tool_service_pb2_grpc.ToolServiceStub) -> None:
    # out/ is read 64 folders deep; what lies below was once dropped without a word.
    code = ("import os\nos.chdir(os.environ['OUTPUT_DIR'])\n"
            "open('top.txt', 'w').write('top')\n"
            "for _ in range(70):\n    os.mkdir('d')\n    os.chdir('d')\n"
            "open('bottom.txt', 'w').write('x')\n")
    events = await asyncio.wait_for(run_tool(served, "python", {"code": code}), 30)

    result = events[-1].result
    assert [f.name for f in result.writeback.sent_files] == ["top.txt"]
    assert as_dict(result)["structured_output"]["skipped_files"] == [
        "/".join(["d"] * 65) + ": more than 64 folders deep; not looked into"]


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A sandbox root of this test alone (its parent traversable by every run user), so
    the folders in it are the test's runs' only."""
    parent = Path("/tmp") / f"sbx-boundary-{secrets.token_hex(4)}"
    parent.mkdir(mode=0o755)
    try:
        yield parent / "box"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


NESTING = ("import os\nos.chdir(os.environ['OUTPUT_DIR'])\n"
           "for _ in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\n"
           "open('bottom.txt', 'w').write('x')\n"
           "os.chmod('.', 0o500)\nos.chdir('..')\nos.chmod('d', 0)\n"
           "print(os.getcwd().count('/'))\n")


async def test_1200_nested_folders_end_with_a_normal_result(
        served: tool_service_pb2_grpc.ToolServiceStub) -> None:
    events = await run_tool(served, "python", {"code": NESTING})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result.error.message
    assert int(result.output.split()[0]) > 1200


@pytest.mark.parametrize("mode", MODES)
async def test_1200_nested_folders_are_removed(tmp_path: Path, shared_root: Path,
                                               mode: str) -> None:
    box = sandbox(tmp_path, mode, sandbox_root=shared_root)
    result = await box.run(["python3", "-I", "-c", NESTING])

    assert result.verdict.ok, result.stderr_tail
    assert os.listdir(shared_root) == []


async def test_many_files_under_the_file_cap_stop_at_the_disk_limit(make_server: Any) -> None:
    server = await make_server(**LIMITS, sandbox_disk_mb=32)
    code = ("import os, time\nfor i in range(8):\n"
            "    open(f'f{i}', 'wb').write(os.urandom(8 * 1024 * 1024))\n"
            "print('written', flush=True)\ntime.sleep(50)\n")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "python", {"code": code})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert (result.error.code, result.error.message) == (
        "DISK_LIMIT", "stopped: disk limit of 32 MB exceeded")
    assert as_dict(result)["structured_output"]["duration_seconds"] < 45


async def test_many_empty_files_count_against_the_disk_limit(tmp_path: Path) -> None:
    box = sandbox(tmp_path, sandbox_disk_mb=4)
    result = await box.run(["sh", "-c", "mkdir out/many && cd out/many && "
                                        "seq 1 2000 | xargs touch"])

    assert result.verdict.code == "DISK_LIMIT"


@pytest.mark.parametrize("place", ["/tmp", "/dev/shm"])
async def test_bwrap_private_tmpfs_is_bounded_by_the_disk_limit(tmp_path: Path,
                                                                 place: str) -> None:
    box = sandbox(tmp_path, "bwrap", sandbox_disk_mb=16)
    result = await box.run(["sh", "-c", f"for i in 1 2 3; do head -c 10000000 /dev/zero "
                                        f"> {place}/big$i || exit 1; done"])

    assert result.verdict.code == "DISK_LIMIT"
    assert result.verdict.message == "stopped: disk limit of 16 MB exceeded"


async def test_bwrap_has_no_other_writable_place(tmp_path: Path) -> None:
    box = sandbox(tmp_path, "bwrap")
    result = await box.run(["sh", "-c", "for p in /x /dev/x /usr/x /proc/x; do "
                                        "echo > $p && echo WROTE $p; done; true"])

    assert "WROTE" not in result.stdout_tail
    assert result.stderr_tail.count("Read-only file system") >= 2


PEEK = ("cat {run}/secret.txt {run}/out/secret.txt; ls -la {run} {run}/out; "
        "cat /proc/[0-9]*/cwd/secret.txt /proc/[0-9]*/cwd/out/secret.txt; "
        "ls /proc/[0-9]*/cwd/; true")


@pytest.mark.parametrize("mode", MODES)
async def test_a_run_cannot_read_another_live_runs_files(tmp_path: Path, shared_root: Path,
                                                         mode: str) -> None:
    box = sandbox(tmp_path, mode, sandbox_root=shared_root)
    started = asyncio.Event()

    async def on_output(channel: str, text: str) -> None:
        started.set()

    live = asyncio.create_task(box.run(
        ["sh", "-c", "echo SECRET-OF-A > secret.txt; cp secret.txt out/; echo up; "
                     "exec sleep 60"], on_output=on_output))
    try:
        await asyncio.wait_for(started.wait(), 30)
        [other] = [shared_root / name for name in os.listdir(shared_root)
                   if name.startswith("run-")]
        peek = await box.run(["sh", "-c", PEEK.format(run=other)])
    finally:
        live.cancel()
        with pytest.raises(asyncio.CancelledError):
            await live

    assert "SECRET-OF-A" not in peek.stdout_tail
    assert "secret.txt" not in peek.stdout_tail


@pytest.mark.skipif(os.geteuid() != 0, reason="per-run users need a root server")
async def test_concurrent_runs_get_users_of_their_own(tmp_path: Path) -> None:
    box = sandbox(tmp_path)
    first, second = await asyncio.gather(*(box.run(["sh", "-c", "id -u; sleep 0.5"])
                                           for _ in range(2)))

    uids = {int(first.stdout_tail), int(second.stdout_tail)}
    assert len(uids) == 2
    assert all(2_000_000_000 <= uid <= 2_000_065_535 for uid in uids)


#: Runs the runner as a non-root server would: argv is (base folder, code, code, ...); prints
#: what each run returned as one JSON line.
AS_SERVER = """
import asyncio, json, os, sys
from stargrpc.sandbox import Sandbox
from stargrpc.sandbox.runner import removals
from stargrpc.settings import Settings

async def main():
    base = sys.argv[1]
    box = Sandbox(Settings.load(state_dir=base + "/state", sandbox_root=base + "/box"))
    runs = []
    for code in sys.argv[2:]:
        result = await box.run(["python3", "-I", "-c", code])
        runs.append({"verdict": result.verdict.code, "stderr": result.stderr_tail,
                     "files": [(f.name, f.data.decode(errors="replace")) for f in result.files],
                     "skipped": result.skipped_files})
    await removals()  # a small run's folder goes right after its result
    print(json.dumps({"mode": box.isolation.mode, "runs": runs,
                      "left": os.listdir(base + "/box")}))

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a non-root server")
def test_a_non_root_server_keeps_its_state_dir_and_removes_what_it_cannot_read(
        tmp_path: Path) -> None:
    uid = 2_100_000_000 + secrets.randbelow(1_000_000)
    base = Path("/tmp") / f"sbx-nonroot-{secrets.token_hex(4)}"
    try:
        (base / "state").mkdir(parents=True)
        (base / "state" / "keys.json").write_text("KEYS-FILE-CONTENT")
        for path in (base, base / "state", base / "state" / "keys.json"):
            os.chown(path, uid, uid)
        done = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
             "-c", AS_SERVER, str(base), swap_out(str(base / "state")), NESTING],
            capture_output=True, text=True, timeout=120, cwd="/tmp",
            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(Path.cwd())}, check=False)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    swap, nest = report["runs"]

    assert (swap["files"], swap["skipped"]) == ([], [NOT_A_FOLDER])
    assert "KEYS" not in done.stdout and "keys.json" not in done.stdout
    assert nest["verdict"] == "OK", nest["stderr"]
    assert report["left"] == []
