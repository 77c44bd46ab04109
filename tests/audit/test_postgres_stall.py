"""The audit trail when PostgreSQL stalls (SIGSTOP, not a crash) mid-write: calls still get
their Result within ``audit_commit_timeout_seconds``, the server keeps serving, and once the
database resumes every record is written and the chain is intact.

The test runs a PostgreSQL cluster of its own (initdb in its tmp dir, a free loopback port,
stopped at the end): the shared server on 5432 is never stopped."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from stargrpc.audit.chain import verify
from stargrpc.audit.key import load_key
from stargrpc.audit.store import open_store
from stargrpc.v1 import tool_service_pb2_grpc
from tests.conftest import ServerFactory
from tests.helpers import eventually_sync, free_port, run_tool

_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
TIMEOUT = 60


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _as_postgres(*argv: str) -> list[str]:
    # initdb and postgres refuse to run as root.
    return argv if os.geteuid() != 0 else ["setpriv", "--reuid=postgres", "--regid=postgres",
                                            "--init-groups", "--", *argv]


@pytest.fixture
def own_postgres() -> Iterator[tuple[str, list[int]]]:
    """A PostgreSQL cluster of this test: (URL, [its postmaster's pid])."""
    if not _BIN:
        pytest.fail("PostgreSQL's binaries are missing (apt-get install postgresql)")
    # Not under pytest's tmp dir: as root that is 0700, and postgres runs as its own user.
    home = Path(tempfile.mkdtemp(prefix="stargrpc-pg-"))
    data = home / "pg"
    data.mkdir()
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(home, entry.pw_uid, entry.pw_gid)
        os.chown(data, entry.pw_uid, entry.pw_gid)
    subprocess.run(_as_postgres(f"{_BIN[-1]}/initdb", "-D", str(data), "-A", "trust",
                                "-U", "postgres"), check=True, capture_output=True,
                   timeout=TIMEOUT)
    port = free_port()
    server = subprocess.Popen(_as_postgres(
        f"{_BIN[-1]}/postgres", "-D", str(data), "-p", str(port), "-k", str(home),
        "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        eventually_sync(lambda: _accepts(port), within=TIMEOUT, interval=0.05,
                        what="PostgreSQL accepting connections")
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres", [server.pid]
    finally:
        _signal_cluster(server.pid, signal.SIGCONT)
        server.terminate()
        try:
            server.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(home, ignore_errors=True)


def _cluster_pids(postmaster: int) -> list[int]:
    """The postmaster and its children (the backends serving the connections)."""
    found = [postmaster]
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                found.append(int(entry.name))
    return found


def _signal_cluster(postmaster: int, sig: signal.Signals) -> None:
    for pid in _cluster_pids(postmaster):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def test_a_stalled_postgresql_delays_no_result_and_loses_no_record(
        make_server: ServerFactory, own_postgres: tuple[str, list[int]]) -> None:
    url, (postmaster,) = own_postgres
    server = await make_server(audit_store=url, audit_commit_timeout_seconds=1.0,
                               audit_close_timeout_seconds=30.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        before = await run_tool(stub, "echo", {"text": "before"})
        _signal_cluster(postmaster, signal.SIGSTOP)
        try:
            started = time.monotonic()
            during = await asyncio.wait_for(
                asyncio.gather(*(run_tool(stub, "echo", {"text": f"during {i}"})
                                 for i in range(5))), TIMEOUT)
            took = time.monotonic() - started
        finally:
            _signal_cluster(postmaster, signal.SIGCONT)
        after = await run_tool(stub, "echo", {"text": "after"})
    await server.stop(grace=30)

    # Every caller got its Result: the stall cost at most the commit wait, not a hang.
    assert before[-1].result.output == "before" and after[-1].result.output == "after"
    assert [events[-1].result.output for events in during] == [f"during {i}" for i in range(5)]
    assert took < TIMEOUT
    # Nothing was lost: the records queued during the stall were written when it ended.
    key = load_key(Path(server.settings.state_dir) / "audit-hmac.key")
    store = open_store(url, key)
    await store.open()
    try:
        records = [r async for r in store.scan()]
        report = await verify(store.scan(), [key])
    finally:
        await store.aclose()
    assert report.intact, report
    assert sorted(r.run_id for r in records if r.tool == "echo") == sorted(
        events[-1].run_id for events in (before, *during, after))
