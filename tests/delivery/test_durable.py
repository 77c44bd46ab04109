"""A StartRun that was answered has a delivery that outlives its server: replicas of a fleet
SIGKILLed the moment they acknowledge StartRuns (the surviving replica delivers every
acknowledged run's Result, or RUN_LOST), and a lone server SIGKILLed with webhook deliveries
pending (restarted on the same state folder, it delivers them all)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from redis.asyncio import Redis

from stargrpc.delivery.journal import JOURNAL_NAME
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.delivery.helpers import KEY, receiver_module, start_request, with_webhook
from tests.helpers import eventually
from tests.procs import ServerProcess, server_env
from tests.runs_support import RUN_TOOLS_DIR
from tests.stores.conftest import REDIS_URL

pytestmark = pytest.mark.timeout(240)

#: StartRuns sent to the replica that is killed, all at once.
CALLS = 100
#: The acknowledgement at which it is killed: later ones race the kill.
KILL_AT = 40


@contextmanager
def replica_pair(tmp_path: Path, prefix: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Replicas sharing Redis under ``prefix`` with a 1 s lease, started side by side."""
    def start(name: str) -> ServerProcess:
        return ServerProcess(
            ["--tools-dir", str(RUN_TOOLS_DIR), "--redis-url", REDIS_URL],
            server_env(tmp_path / name, STARGRPC_REDIS_KEY_PREFIX=prefix,
                       STARGRPC_RUN_LEASE_SECONDS="1"))

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, name) for name in ("survivor", "doomed")]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 2:
            raise next(f.exception() for f in futures if f.exception() is not None)
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


async def _results(redis: Redis, key: str, wanted: set[str], within: float
                   ) -> dict[str, dict[str, str]]:
    """The stream entries of the runs in ``wanted``, by run id, once all came (bounded)."""
    found: dict[str, dict[str, str]] = {}
    last = "0-0"
    try:
        async with asyncio.timeout(within):
            while not wanted <= found.keys():
                reply = await redis.xread({key: last}, count=200, block=500)
                for _, entries in reply:
                    for entry_id, fields in entries:
                        last = entry_id
                        entry = {k.decode(): v.decode() for k, v in fields.items()}
                        found.setdefault(entry["run_id"], entry)
    except TimeoutError:
        pass  # the assertion names what is missing
    return found


async def test_every_acknowledged_start_run_is_delivered_after_a_sigkill_at_the_ack(
        tmp_path: Path, redis_prefix: str) -> None:
    acknowledged: list[str] = []
    redis = Redis.from_url(REDIS_URL)
    try:
        with replica_pair(tmp_path, redis_prefix) as (survivor, doomed):
            async with grpc.aio.insecure_channel(doomed.target) as channel:
                stub = tool_service_pb2_grpc.ToolServiceStub(channel)

                async def start(i: int) -> None:
                    # Short runs and runs that never end, side by side: a run that ended
                    # before the kill is delivered with its Result, one cut short RUN_LOST.
                    arguments = ({"text": f"run {i}"} if i % 2 else
                                 {"path": str(tmp_path / "tally"),
                                  "gate": str(tmp_path / "never")})
                    started = await stub.StartRun(
                        start_request("echo" if i % 2 else "tally", arguments, "results"),
                        timeout=20)
                    acknowledged.append(started.run_id)
                    if len(acknowledged) == KILL_AT:
                        doomed.signal(signal.SIGKILL)  # at once: no await in between

                await asyncio.gather(*(start(i) for i in range(CALLS)),
                                     return_exceptions=True)
            assert len(acknowledged) >= KILL_AT
            delivered = await _results(redis, f"{redis_prefix}results", set(acknowledged),
                                       60)
            # Runs killed between their delivery's registration and their answer are
            # delivered too; then nothing is left pending.

            async def none_pending() -> bool:
                return not await redis.hlen(f"{redis_prefix}delivery:pending")

            # The survivor writes it: no event to await.
            await eventually(none_pending, within=30, interval=0.1, what="no delivery pending")
            pending = await redis.hlen(f"{redis_prefix}delivery:pending")
            assert survivor.proc.poll() is None
    finally:
        await redis.aclose()

    missing = set(acknowledged) - delivered.keys()
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged runs undelivered"
    outcomes = {(entry["outcome"], json.loads(entry["result"]).get("error", {}).get("code", ""))
                for entry in (delivered[run_id] for run_id in acknowledged)}
    assert outcomes <= {("OUTCOME_OK", ""), ("OUTCOME_ERROR", "RUN_LOST")}
    assert pending == 0


@pytest.fixture
def refusing_receiver(tls):
    """The example receiver, answering 503 until the test lets it take deliveries."""
    receiver = receiver_module.serve(0, KEY, tls["tls_cert_file"], tls["tls_key_file"],
                                     fail_first=10**9)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.shutdown()
        receiver.server_close()
        thread.join(5)


def _lone_server(state: Path, tls: dict[str, Path], secret: Path) -> ServerProcess:
    return ServerProcess(
        ["--tools-dir", str(RUN_TOOLS_DIR)],
        server_env(state, STARGRPC_DELIVERY_ALLOWLIST="127.0.0.1",
                   STARGRPC_DELIVERY_ALLOWED_NETWORKS="127.0.0.1/32",
                   STARGRPC_DELIVERY_WEBHOOK_SECRET_FILE=str(secret),
                   STARGRPC_DELIVERY_CA_FILE=str(tls["tls_client_ca_file"]),
                   STARGRPC_DELIVERY_RETRY_INITIAL_SECONDS="0.05",
                   STARGRPC_DELIVERY_RETRY_MAX_INTERVAL_SECONDS="0.2",
                   STARGRPC_DELIVERY_RETRY_SECONDS="120"))


async def test_a_lone_server_delivers_its_pending_webhooks_after_a_sigkill_and_restart(
        tmp_path: Path, tls, refusing_receiver) -> None:
    state = tmp_path / "state"
    secret = tmp_path / "delivery.key"
    secret.write_bytes(KEY)
    url = f"https://127.0.0.1:{refusing_receiver.server_address[1]}/hook"
    first = _lone_server(state, tls, secret)
    try:
        async with grpc.aio.insecure_channel(first.target) as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            # Two runs that end at once, their deliveries refused (retried) when it dies...
            ended = [(await stub.StartRun(with_webhook(url))).run_id for _ in range(2)]
            for run_id in ended:
                first.wait_for(lambda line, run_id=run_id: line.get("event") ==
                               "delivery_attempt_failed" and line.get("run_id") == run_id, 30)
            # ... and five that are still going, killed the moment the last is acknowledged.
            going: list[str] = []
            for _ in range(5):
                request = tool_service_pb2.StartRunRequest(
                    tool_name="tally", arguments_json=json.dumps(
                        {"path": str(tmp_path / "tally"), "gate": str(tmp_path / "never")}))
                request.delivery.webhook.url = url
                going.append((await stub.StartRun(request)).run_id)
            first.signal(signal.SIGKILL)
        first.proc.wait(10)
        refusing_receiver.fail_first = 0
        second = _lone_server(state, tls, secret)
        try:
            with contextlib.suppress(TimeoutError):  # the assertion names what is missing
                async with asyncio.timeout(30):
                    while not set(ended + going) <= refusing_receiver.deliveries.keys():
                        await asyncio.to_thread(refusing_receiver.received.wait, 1.0)
                        refusing_receiver.received.clear()
            missing = set(ended + going) - refusing_receiver.deliveries.keys()
            assert not missing, f"{len(missing)} of 7 pending deliveries lost in the restart"
            for run_id in ended + going:  # each delivery's final state is known
                second.wait_for(lambda line, run_id=run_id: line.get("event") == "delivered"
                                and line.get("run_id") == run_id, 30)
        finally:
            second.stop()
    finally:
        first.stop()
    journal_mode = stat.S_IMODE(os.stat(state / JOURNAL_NAME).st_mode)
    with contextlib.closing(sqlite3.connect(state / JOURNAL_NAME)) as db:
        left = db.execute("SELECT count(*) FROM pending").fetchone()[0]

    deliveries = refusing_receiver.deliveries
    assert [deliveries[r]["result"]["outcome"] for r in ended] == ["OUTCOME_OK"] * 2
    assert [deliveries[r]["result"]["output"] for r in ended] == ["delivered"] * 2
    assert [(deliveries[r]["result"]["outcome"], deliveries[r]["result"]["error"]["code"])
            for r in going] == [("OUTCOME_ERROR", "RUN_LOST")] * 5
    assert {deliveries[r]["tool_name"] for r in going} == {"tally"}
    assert journal_mode == 0o600
    assert left == 0
