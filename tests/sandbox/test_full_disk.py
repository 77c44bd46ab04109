"""A sandbox disk that cannot take a run's folder (full, over quota, failing): the python and
shell tools end FAILED SANDBOX_UNAVAILABLE saying so, not with an internal error; a warm
sandbox discarded for it is counted as ``setup_failed``, not ``tampered``; and once space is
freed the calls work again.

The disk is made full two ways: by making the write of the run's input files fail with the
errno a full disk gives (any user), and, as root (as CI runs), by filling a small tmpfs
mounted as ``sandbox_root``.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from stargrpc.metrics import REGISTRY
from stargrpc.sandbox import runner, warm
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import run_tool

CALLS = {"python": {"code": "print(6 * 7)"}, "shell": {"command": "echo 42"}}
#: The kind of warm sandbox each tool takes.
KIND = {"python": "python", "shell": "exec"}
FULL_DISK = "no space left on the server's sandbox disk"


def discarded(kind: str, reason: str) -> float:
    return REGISTRY.get_sample_value("stargrpc_sandbox_pool_discarded_total",
                                     {"kind": kind, "reason": reason}) or 0.0


async def call(port: int, tool: str) -> events_pb2.Result:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, tool, CALLS[tool])
    return events[-1].result


def fail_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Every write of a run's input files fails with ``code``, cold or warm, as the disk
    holding ``sandbox_root`` would."""

    def write_inputs(*args: Any, **kwargs: Any) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(runner, "write_inputs", write_inputs)
    monkeypatch.setattr(warm, "write_inputs", write_inputs)


@pytest.mark.parametrize("pool", [0, 1, 2])
@pytest.mark.parametrize("tool", ["python", "shell"])
async def test_a_full_sandbox_disk_fails_the_call_clearly_until_space_is_freed(
        make_server, monkeypatch, tool, pool) -> None:
    server = await make_server(sandbox_warm_pool=pool)
    if pool:
        await server.warm_pool.filled()
    setup_failed = discarded(KIND[tool], "setup_failed")
    tampered = discarded(KIND[tool], "tampered")
    fail_writes(monkeypatch, errno.ENOSPC)

    full = await call(server.port, tool)
    monkeypatch.undo()  # space is freed
    freed = await call(server.port, tool)

    assert full.outcome == events_pb2.OUTCOME_FAILED
    assert full.error.code == "SANDBOX_UNAVAILABLE"
    assert FULL_DISK in full.error.message
    assert freed.outcome == events_pb2.OUTCOME_OK, freed.error.message
    assert freed.output.startswith("42\n")
    # The warm sandbox it was handed first is discarded for what it was: a full disk; the
    # next one is left for a run once space is freed (it would fail the same way).
    assert discarded(KIND[tool], "setup_failed") == setup_failed + min(pool, 1)
    assert discarded(KIND[tool], "tampered") == tampered


@pytest.mark.parametrize(("code", "said"), [
    (errno.EDQUOT, FULL_DISK),
    (errno.EIO, "the run's folder could not be set up (Input/output error)")])
async def test_other_errors_setting_up_the_folder_are_named_too(make_server, monkeypatch,
                                                                code, said) -> None:
    server = await make_server()
    fail_writes(monkeypatch, code)

    result = await call(server.port, "python")

    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert result.error.code == "SANDBOX_UNAVAILABLE"
    assert said in result.error.message


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs to be ``sandbox_root``, in a folder every sandbox user may traverse;
    unmounted at the end."""
    outer = Path(tempfile.mkdtemp(prefix="stargrpc-full-"))
    outer.chmod(0o755)
    mounted = outer / "sandbox"
    mounted.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0711", "tmpfs",
                    str(mounted)], check=True)
    try:
        yield mounted
    finally:
        subprocess.run(["umount", "-l", str(mounted)], check=False)
        shutil.rmtree(outer, ignore_errors=True)


def fill(disk: Path) -> Path:
    """Fills ``disk`` to its last byte with one file, and returns it."""
    filler = disk / "filler"
    with filler.open("wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
@pytest.mark.parametrize("pool", [0, 1])
async def test_a_really_full_tmpfs_sandbox_root_fails_clearly_until_space_is_freed(
        make_server, small_disk, pool) -> None:
    server = await make_server(sandbox_root=small_disk, sandbox_warm_pool=pool)
    if pool:
        await server.warm_pool.filled()
    tampered = discarded("python", "tampered")
    filler = fill(small_disk)

    full = await call(server.port, "python")
    filler.unlink()
    freed = await call(server.port, "python")

    assert full.outcome == events_pb2.OUTCOME_FAILED
    assert full.error.code == "SANDBOX_UNAVAILABLE"
    assert FULL_DISK in full.error.message
    assert freed.outcome == events_pb2.OUTCOME_OK, freed.error.message
    assert freed.output.startswith("42\n")
    assert discarded("python", "tampered") == tampered


async def test_a_session_on_a_full_sandbox_disk_is_refused_clearly(
        make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = await make_server()
    fail_writes(monkeypatch, errno.ENOSPC)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateSession(tool_service_pb2.CreateSessionRequest(kind="python"))
        monkeypatch.undo()  # space is freed
        created = await stub.CreateSession(tool_service_pb2.CreateSessionRequest(kind="python"))
        await stub.CloseSession(tool_service_pb2.CloseSessionRequest(
            session_id=created.session.session_id))
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert FULL_DISK in (refused.value.details() or "")
    assert created.session.session_id
