"""The journal of a lone server's pending deliveries: private, taken over only from
processes that are gone, and a delivery it cannot keep refuses its call before the run
starts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from stargrpc.delivery import DeliveryTarget
from stargrpc.delivery.journal import JOURNAL_NAME, DeliveryJournal
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.delivery.helpers import make_delivering_server
from tests.runs_support import run_registry

TARGET = DeliveryTarget("webhook", "https://127.0.0.1:1/hook")


def _set_pid(journal: DeliveryJournal, run_id: str, pid: int) -> None:
    journal._connection().execute("UPDATE pending SET pid = ? WHERE run_id = ?", (pid, run_id))


def test_rows_of_live_processes_stay_theirs_and_the_file_is_private(tmp_path: Path) -> None:
    journal = DeliveryJournal(tmp_path / "state" / JOURNAL_NAME)
    for run_id in ("mine", "a live one's", "a dead one's"):
        journal.add(run_id, "echo", TARGET)
    journal.set_result("mine", b"\x08\x01")
    _set_pid(journal, "a live one's", os.getppid())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _set_pid(journal, "a dead one's", gone.pid)
    taken = {p.run_id: p for p in journal.left_behind()}
    again = {p.run_id for p in journal.left_behind()}
    journal.remove("mine")
    left = {p.run_id for p in journal.left_behind()}
    modes = {path.name: stat.S_IMODE(path.stat().st_mode)
             for path in journal.path.parent.glob(f"{JOURNAL_NAME}*")}
    journal.close()

    assert set(taken) == {"mine", "a dead one's"}
    assert taken["mine"].result == b"\x08\x01" and taken["a dead one's"].result is None
    assert taken["mine"].target == TARGET
    assert again == {"mine", "a dead one's"}  # taken over: they name this process now
    assert left == {"a dead one's"}
    # The database and the WAL files SQLite makes beside it, like the rest of the folder.
    assert modes == {name: 0o600 for name in (JOURNAL_NAME, f"{JOURNAL_NAME}-wal",
                                              f"{JOURNAL_NAME}-shm")}


async def test_a_delivery_the_state_folder_cannot_keep_refuses_its_call_before_the_run(
        make_server, tmp_path: Path, tls) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / JOURNAL_NAME).mkdir()  # not a file SQLite can open
    channel, stub = await make_delivering_server(
        lambda **settings: make_server(registry=run_registry(), **settings), tmp_path, tls)
    request = tool_service_pb2.StartRunRequest(
        tool_name="tally", arguments_json=json.dumps({"path": str(tmp_path / "tally")}))
    request.delivery.webhook.url = "https://127.0.0.1:1/hook"
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StartRun(request)
        runs = await tool_service_pb2_grpc.ToolServiceStub(channel).ListRuns(
            tool_service_pb2.ListRunsRequest())

    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not (tmp_path / "tally").exists()  # the run never started
    assert list(runs.runs) == []
