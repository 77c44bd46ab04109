"""``stargrpc serve --workers 2``: two real worker processes on one port behave as one server.

Connections are spread by the kernel (``SO_REUSEPORT``), so each test opens channels until it
holds one to each worker, told apart by the ``whoami`` tool (the worker's process id).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import jwt
import pytest

from stargrpc.sandbox.state_socket import CLIENT_FOLDER
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import eventually
from tests.procs import ServerProcess, server_env
from tests.sandbox.proctable import processes_with, wait_until_gone

pytestmark = pytest.mark.timeout(180)

REDIS_URL = "redis://127.0.0.1:6379/0"
WORKERS = 2
#: Channels opened at most to find a connection to each worker.
MAX_CHANNELS = 60

WHOAMI = '''
from __future__ import annotations

import os

from pydantic import BaseModel

from stargrpc import ToolContext, tool


class NoArgs(BaseModel):
    pass


@tool(kind="test")
async def whoami(ctx: ToolContext, args: NoArgs) -> str:
    """The process id of the worker that ran this."""
    return str(os.getpid())
'''

RELOADED = '''
from __future__ import annotations

from pydantic import BaseModel

from stargrpc import ToolContext, tool


class NoArgs(BaseModel):
    pass


@tool(kind="test")
async def reloaded(ctx: ToolContext, args: NoArgs) -> str:
    """Appears after SIGHUP."""
    return "reloaded"
'''


#: A tools module that, while a file named ``hold`` lies beside it, holds the worker loading
#: it until the test lets go: it connects to the Unix socket the file names, sends its pid
#: and waits for a byte (60 s at most).
GATE = '''
from __future__ import annotations

import os
import socket
from pathlib import Path

_hold = Path(__file__).with_name("hold")
if _hold.exists():
    with socket.socket(socket.AF_UNIX) as _link:
        _link.settimeout(60)
        _link.connect(_hold.read_text())
        _link.sendall(f"{os.getpid()}\\n".encode())
        _link.recv(1)
'''

def _worker_pids(server: ServerProcess) -> set[int]:
    return {int(str(line["pid"])) for line in server.lines
            if line.get("event") == "worker_started"}


@contextmanager
def workers(tmp_path: Path, *args: str, auth: bool = False,
            **env: str) -> Iterator[ServerProcess]:
    """``stargrpc serve --workers 2`` with a Redis key prefix of its own and the ``whoami``
    tool, once both workers serve."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    (tools / "whoami.py").write_text(WHOAMI)
    environ = server_env(tmp_path / "state", STARGRPC_REDIS_KEY_PREFIX=f"t-{uuid.uuid4().hex}:",
                         **env)
    if auth:
        environ.pop("STARGRPC_INSECURE_NO_AUTH")
    server = ServerProcess(["--workers", str(WORKERS), "--redis-url", REDIS_URL,
                            "--tools-dir", str(tools), *args], environ)
    try:
        serving = [line for line in server.lines if line.get("event") == "serving"]
        while len(serving) < WORKERS:
            serving.append(server.wait_for(
                lambda line: line.get("event") == "serving" and line not in serving, 60))
        yield server
    finally:
        pids = _worker_pids(server)
        server.stop(60)
        for pid in pids:  # none outlives the supervisor
            assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), pid


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


async def whoami(channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] = (),
                 idempotency_key: str = "") -> tuple[str, int]:
    """(run id, pid of the worker that ran it)."""
    stub = tool_service_pb2_grpc.ToolServiceStub(channel)
    run_id, output = "", ""
    async for response in stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="whoami", arguments_json="{}", idempotency_key=idempotency_key),
            metadata=tuple(metadata), timeout=30):
        run_id = response.event.run_id
        if response.event.HasField("result"):
            assert response.event.result.outcome == events_pb2.OUTCOME_OK, response
            output = response.event.result.output
    return run_id, int(output)


async def one_channel_per_worker(target: str, metadata: Sequence[tuple[str, str]] = (),
                                 ) -> tuple[dict[int, grpc.aio.Channel], int]:
    """A channel to each worker (by pid), and how many whoami runs finding them took."""
    found: dict[int, grpc.aio.Channel] = {}
    for runs in range(1, MAX_CHANNELS + 1):
        # A subchannel pool of its own: a new connection, not one shared with the others.
        channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool",
                                                              1)])
        _, pid = await whoami(channel, metadata)
        if pid in found:
            await channel.close()
        else:
            found[pid] = channel
        if len(found) == WORKERS:
            return found, runs
    raise AssertionError(f"{MAX_CHANNELS} connections all reached {sorted(found)}")


async def last_event(call: grpc.aio.UnaryStreamCall) -> events_pb2.RunEvent:
    """The last event of a stream already being read with ``read()``."""
    last = None
    while (response := await call.read()) is not grpc.aio.EOF:
        last = response.event
    assert last is not None
    return last


async def lists_reloaded(channel: grpc.aio.Channel) -> bool:
    """Whether the worker behind ``channel`` lists the tool ``reloaded``."""
    reply = await tool_service_pb2_grpc.ToolServiceStub(channel).ListTools(
        tool_service_pb2.ListToolsRequest(), timeout=10)
    return "reloaded" in {t.name for t in reply.tools}


def metric_value(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match and ",".join(sorted((match.group(1) or "").split(","))) == wanted:
            total += float(match.group(2))
    return total


async def test_two_workers_share_runs_keys_audit_and_metrics(tmp_path: Path) -> None:
    with workers(tmp_path, "--metrics-port", "0", auth=True) as server:
        # One first-start admin key, made by the supervisor before any worker started.
        announced = [line for line in server.lines if line.get("event") == "raw"
                     and "no API keys were configured" in str(line.get("text"))]
        assert len(announced) == 1
        keys = json.loads((tmp_path / "state" / "keys.json").read_text())
        assert len(keys["keys"]) == 1
        raw = [str(line["text"]) for line in server.lines if line.get("event") == "raw"]
        key = raw[next(i for i, text in enumerate(raw) if text.endswith("Bearer <key>':")) + 1]
        auth = (("authorization", f"Bearer {key}"),)
        channels, runs = await one_channel_per_worker(server.target, auth)
        try:
            (pid_a, a), (pid_b, b) = channels.items()
            assert {pid_a, pid_b} == _worker_pids(server)
            stub_a = tool_service_pb2_grpc.ToolServiceStub(a)
            stub_b = tool_service_pb2_grpc.ToolServiceStub(b)

            # Idempotency: the same key on the other worker replays the first run.
            first_run, _ = await whoami(a, auth, idempotency_key="same-key")
            again_run, again_pid = await whoami(b, auth, idempotency_key="same-key")
            runs += 1
            assert (again_run, again_pid) == (first_run, pid_a)

            # WatchRun and CancelRun on the other worker reach the run. (The idempotency key
            # registers the run in Redis before its first event, as in
            # tests/stores/test_redis_replicas.py: without one the run store writes events
            # behind, and a WatchRun elsewhere right after the first event may not see it.)
            call = stub_a.Execute(tool_service_pb2.ExecuteRequest(
                tool_name="sleep", arguments_json='{"seconds": 60, "heartbeat_every": 0.2}',
                idempotency_key="sleep-key"),
                metadata=auth, timeout=60)
            run_id = (await call.read()).event.run_id
            watch = stub_b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=run_id),
                                    metadata=auth, timeout=60)
            watched = await watch.read()
            assert watched.event.run_id == run_id and watched.event.seq == 1
            await stub_b.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id),
                                   metadata=auth, timeout=30)
            assert (await last_event(call)).result.outcome == events_pb2.OUTCOME_CANCELLED
            assert (await last_event(watch)).result.outcome == events_pb2.OUTCOME_CANCELLED
        finally:
            for channel in channels.values():
                await channel.close()

        # Metrics add up over the workers, whichever one answers the scrape.
        metrics_port = next(int(str(line["address"]).rsplit(":", 1)[1]) for line in server.lines
                            if line.get("event") == "http_serving"
                            and line.get("what") == "metrics")
        seen = set()
        for _ in range(6):
            async with httpx.AsyncClient() as client:  # a new connection each time
                text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            seen.add((metric_value(text, "tool_executor_tasks_total", tool="whoami",
                                   outcome="ok"),
                      metric_value(text, "tool_executor_tasks_total", tool="sleep",
                                   outcome="cancelled"),
                      metric_value(text, "tool_executor_runs_in_flight")))
        assert seen == {(float(runs), 1.0, 0.0)}, text

    # One intact audit chain in the shared SQLite file, every call in it.
    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "stargrpc.cli", "audit", "verify", "--store",
                         f"sqlite:///{tmp_path / 'state' / 'audit.db'}"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    checked = re.search(r"ok: (\d+) records", result.stdout)
    assert checked is not None and int(checked.group(1)) >= runs + 2  # + the replay, sleep


async def test_two_workers_share_a_lanes_one_slot(tmp_path: Path) -> None:
    """Lane ``one`` of one slot under ``--workers 2``: a call on each worker at once, one
    runs and the other queues (its QUEUED notice first); ListRuns on either worker shows
    one of the lane's runs running, the other queued; the queued one starts only after the
    first's Result is in its log (its START stamped after that Result), and is then the one
    listed running (on the other worker once the first's Result is in Redis)."""
    lanes = {"one": {"max_concurrent": 1, "max_queued": 10}}
    with workers(tmp_path, STARGRPC_LANES=json.dumps(lanes),
                 STARGRPC_TOOL_LANES=json.dumps({"sleep": "one"})) as server:
        channels, _ = await one_channel_per_worker(server.target)
        try:
            stubs = [tool_service_pb2_grpc.ToolServiceStub(c) for c in channels.values()]
            calls = [stub.Execute(tool_service_pb2.ExecuteRequest(
                tool_name="sleep", arguments_json='{"seconds": 60, "heartbeat_every": 0.2}',
                idempotency_key=f"lane-{i}"), timeout=90) for i, stub in enumerate(stubs)]
            firsts = await asyncio.gather(*(call.read() for call in calls))
            kinds = [response.event.WhichOneof("kind") for response in firsts]
            assert sorted(kinds) == ["notice", "step"], firsts
            running_at = kinds.index("step")
            ahead, behind = calls[running_at], calls[1 - running_at]
            notice = firsts[1 - running_at].event.notice
            assert (notice.code, notice.queued.lane, notice.queued.position) == ("QUEUED",
                                                                                 "one", 1)
            ahead_id = firsts[running_at].event.run_id
            behind_id = firsts[1 - running_at].event.run_id
            listings: list[list[tuple[str, int]]] = []

            async def lane_listed(stub: tool_service_pb2_grpc.ToolServiceStub) -> bool:
                page = await stub.ListRuns(tool_service_pb2.ListRunsRequest(lane="one"),
                                           timeout=30)
                listings.append(sorted((run.run_id, run.state) for run in page.runs))
                return listings[-1] == sorted([(ahead_id, tool_service_pb2.RUN_STATE_RUNNING),
                                               (behind_id, tool_service_pb2.RUN_STATE_QUEUED)])

            for stub in stubs:  # each worker sees the lane as it is: one running, one queued
                await eventually(lambda stub=stub: lane_listed(stub), within=20,
                                 what=lambda: f"the lane's runs: {listings[-1]}")
            await stubs[1 - running_at].CancelRun(tool_service_pb2.CancelRunRequest(
                run_id=ahead_id), timeout=30)
            ended = await last_event(ahead)
            assert ended.result.outcome == events_pb2.OUTCOME_CANCELLED
            started = (await behind.read()).event
            while not started.HasField("step"):  # (a moved place would come as a notice)
                started = (await behind.read()).event
            assert started.step.phase == events_pb2.STEP_PHASE_START
            assert started.time.ToNanoseconds() >= ended.time.ToNanoseconds()
            async def running_listed(stub: tool_service_pb2_grpc.ToolServiceStub) -> bool:
                page = await stub.ListRuns(tool_service_pb2.ListRunsRequest(
                    lane="one", state=tool_service_pb2.RUN_STATE_RUNNING), timeout=30)
                running = [run.run_id for run in page.runs]
                # The other worker reads the first run's state from Redis, where its Result
                # lands in a round trip of its own beside the slot's release.
                assert set(running) <= {ahead_id, behind_id}, running
                return running == [behind_id]

            for stub in stubs:
                await eventually(lambda stub=stub: running_listed(stub), within=20,
                                 what="the lane's one running run")
            await stubs[running_at].CancelRun(tool_service_pb2.CancelRunRequest(
                run_id=behind_id), timeout=30)
            assert (await last_event(behind)).result.outcome == events_pb2.OUTCOME_CANCELLED
            # No listing while the first run held the slot showed both running.
            assert all(sum(state == tool_service_pb2.RUN_STATE_RUNNING for _, state in listed)
                       <= 1 for listed in listings)
        finally:
            for channel in channels.values():
                await channel.close()


async def test_a_killed_worker_is_restarted_sighup_reloads_all_sigterm_drains_all(
        tmp_path: Path) -> None:
    with workers(tmp_path) as server:
        channels, _ = await one_channel_per_worker(server.target)
        for channel in channels.values():
            await channel.close()
        victim = min(channels)
        os.kill(victim, signal.SIGKILL)
        exited = await asyncio.to_thread(server.wait_for, lambda line: line.get(
            "event") == "worker_exited" and line.get("pid") == victim, 30)
        assert exited["status"] == "killed by SIGKILL"
        restarted = await asyncio.to_thread(server.wait_for, lambda line: line.get(
            "event") == "worker_started" and line.get("worker") == exited["worker"]
            and line.get("pid") != victim, 30)
        earlier = [line for line in server.lines if line.get("event") == "serving"]
        await asyncio.to_thread(server.wait_for, lambda line: line.get("event") == "serving"
                                and line.get("worker") == exited["worker"]
                                and all(line is not seen for seen in earlier), 60)
        channels, _ = await one_channel_per_worker(server.target)
        assert restarted["pid"] in channels and victim not in channels

        # SIGHUP: every worker's catalog gains the new tool.
        (tmp_path / "tools" / "reloaded.py").write_text(RELOADED)
        server.signal(signal.SIGHUP)
        for channel in channels.values():
            await eventually(lambda channel=channel: lists_reloaded(channel), within=30,
                             interval=0.1, what="a worker reloaded")

        # SIGTERM: the run in flight on each worker ends with its Result, then all exit.
        calls = [tool_service_pb2_grpc.ToolServiceStub(channel).Execute(
            tool_service_pb2.ExecuteRequest(tool_name="count",
                                            arguments_json='{"to": 4, "delay": 0.25}'),
            timeout=60) for channel in channels.values()]
        for call in calls:
            await call.read()  # started
        server.signal(signal.SIGTERM)
        for call in calls:
            last = await last_event(call)
            assert last.result.outcome == events_pb2.OUTCOME_OK
            assert last.result.output == "counted to 4"
        for channel in channels.values():
            await channel.close()
        assert await asyncio.to_thread(server.proc.wait, 60) == 0
        done = await asyncio.to_thread(
            server.wait_for, lambda line: line.get("event") == "workers_stopped", 10)
        assert done["exit_status"] == 0
        stopped = [line for line in server.lines if line.get("event") == "worker_stopped"]
        assert {line["status"] for line in stopped} == {"exit status 0"}
        assert len(stopped) == WORKERS


async def test_secrets_reach_the_workers_but_not_their_environment(tmp_path: Path) -> None:
    secret = "workers-hs256-secret-" + uuid.uuid4().hex
    issuer, audience = "https://idp.example", "stargrpc"
    with workers(tmp_path, auth=True, STARGRPC_JWT_SECRET=secret, STARGRPC_JWT_ISSUER=issuer,
                 STARGRPC_JWT_AUDIENCE=audience) as server:
        now = int(time.time())
        token = jwt.encode({"sub": "user-1", "iss": issuer, "aud": audience, "iat": now,
                            "exp": now + 300, "roles": ["admin"]}, secret, algorithm="HS256")
        auth = (("authorization", f"Bearer {token}"),)
        channels, _ = await one_channel_per_worker(server.target, auth)  # both accept it
        for channel in channels.values():
            await channel.close()
        for pid in (server.proc.pid, *channels):
            for name in ("environ", "cmdline"):
                shown = await asyncio.to_thread(Path(f"/proc/{pid}/{name}").read_bytes)
                assert secret.encode() not in shown, (pid, name)


def test_more_than_one_worker_without_a_shared_run_store_is_refused(tmp_path: Path) -> None:
    env = server_env(tmp_path)
    env.pop("STARGRPC_REDIS_URL", None)
    done = subprocess.run([sys.executable, "-m", "stargrpc.cli", "serve", "--workers", "2",
                           "--port", "0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "needs a run store the processes share: set redis_url (--redis-url)" in done.stderr


def test_auto_is_the_number_of_usable_cores() -> None:
    settings = Settings.load(workers="auto", redis_url=REDIS_URL)
    assert settings.workers == len(os.sched_getaffinity(0))
    assert Settings.load().workers == 1


async def test_a_worker_still_starting_takes_sighup_as_a_reload(tmp_path: Path) -> None:
    """SIGHUP reaches a replacement worker twice while it starts — while its interpreter
    starts, then while it loads its tools — and neither ends it: it serves, with the tool
    added after it had listed its tools folder."""
    held: asyncio.Queue[tuple[int, asyncio.StreamWriter]] = asyncio.Queue()

    async def on_link(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await held.put((int(await reader.readline()), writer))

    async def hold_on(server: ServerProcess, pid: int) -> asyncio.StreamWriter:
        """The link of worker ``pid`` (now loading its tools); any other worker that comes
        meanwhile — reloading, it loads the gate too — goes on at once."""
        deadline = time.monotonic() + 60
        while True:
            try:
                other, writer = await asyncio.wait_for(held.get(), 0.5)
            except TimeoutError:
                if _is_zombie(pid):
                    exited = await asyncio.to_thread(server.wait_for, lambda line: line.get(
                        "event") == "worker_exited" and line.get("pid") == pid, 10)
                    raise AssertionError(f"the starting worker ended: {exited}") from None
                assert time.monotonic() < deadline, "the starting worker never loaded its tools"
                continue
            if other == pid:
                return writer
            writer.write(b"g")
            writer.close()

    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "gate.py").write_text(GATE)
    link_path = tmp_path / "link.sock"
    link = await asyncio.start_unix_server(on_link, path=str(link_path))
    try:
        with workers(tmp_path) as server:
            channels, _ = await one_channel_per_worker(server.target)
            for channel in channels.values():
                await channel.close()
            victim = min(channels)
            index = next(line["worker"] for line in server.lines
                         if line.get("event") == "worker_started" and line.get("pid") == victim)
            (tools / "hold").write_text(str(link_path))
            os.kill(victim, signal.SIGKILL)
            started = await asyncio.to_thread(server.wait_for, lambda line: line.get(
                "event") == "worker_started" and line.get("worker") == index
                and line.get("pid") != victim, 30)
            newcomer = int(str(started["pid"]))
            server.signal(signal.SIGHUP)  # the newcomer's interpreter is still starting

            release = await hold_on(server, newcomer)  # it is loading its tools, the list made
            (tools / "hold").unlink()
            (tools / "reloaded.py").write_text(RELOADED)
            earlier = [line for line in server.lines if line.get("event") in (
                "workers_reloading", "serving")]
            server.signal(signal.SIGHUP)
            await asyncio.to_thread(server.wait_for, lambda line: line.get(
                "event") == "workers_reloading" and all(line is not e for e in earlier), 30)
            release.write(b"g")  # the signal has been sent to it: let it finish loading
            release.close()

            ended = await asyncio.to_thread(server.wait_for, lambda line: (
                line.get("event") == "serving" and line.get("worker") == index
                and all(line is not e for e in earlier)) or (
                line.get("event") == "worker_exited" and line.get("pid") == newcomer), 60)
            assert ended["event"] == "serving", ended
            channels, _ = await one_channel_per_worker(server.target)
            try:
                assert newcomer in channels
                for channel in channels.values():  # both workers: the reload took effect
                    await eventually(lambda channel=channel: lists_reloaded(channel),
                                     within=30, interval=0.1, what="a worker reloaded")
            finally:
                for channel in channels.values():
                    await channel.close()
            assert not [line for line in server.lines if line.get("event") == "worker_exited"
                        and line.get("pid") != victim]
    finally:
        link.close()
        await link.wait_closed()


async def test_each_worker_keeps_its_own_warm_pool_and_leaves_none_behind(
        tmp_path: Path) -> None:
    # Under /tmp, not tmp_path: the sandbox users must be able to reach their folders.
    root = Path(tempfile.mkdtemp(prefix="stargrpc-workers-pool-"))
    try:
        with workers(tmp_path, "--metrics-port", "0", STARGRPC_SANDBOX_WARM_POOL="1",
                     STARGRPC_SANDBOX_ROOT=str(root)) as server:
            metrics_port = next(int(str(line["address"]).rsplit(":", 1)[1])
                                for line in server.lines if line.get("event") == "http_serving"
                                and line.get("what") == "metrics")

            async def pooled() -> float:
                async with httpx.AsyncClient() as client:
                    text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
                return (metric_value(text, "stargrpc_sandbox_pool_ready", kind="python")
                        + metric_value(text, "stargrpc_sandbox_pool_ready", kind="exec"))

            # One of each kind per worker, summed over the live workers.
            await eventually(lambda: _ready_is(pooled, 4.0),
                             within=60, what="two warm sandboxes per worker")
            assert len(processes_with(str(root))) >= 4  # each pooled bubblewrap names it
        assert await wait_until_gone(str(root)) == []
        # No run's folder is left; the state client's folder (the server's, shown read-only
        # to pooled sandboxes) stays.
        assert os.listdir(root) in ([], [CLIENT_FOLDER])
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _ready_is(pooled: Callable[[], Awaitable[float]], wanted: float) -> bool:
    return await pooled() == wanted
