"""Every run's receipt (``Result.usage``) through a real server: what a sandboxed run
measures of its process tree, what an in-process tool leaves unset, and where the receipt
goes — the audit record, the metrics, the Python SDK and ``stargrpc call``."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from pydantic import BaseModel

from stargrpc import ToolContext, metrics, tool
from stargrpc.audit.record import AuditRecord
from stargrpc.cli.client_commands import TextRenderer
from stargrpc.client import AsyncClient, Usage
from stargrpc.registry import Registry, load_registry, spec_of
from stargrpc.sandbox import isolation_for
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import ServerFactory
from tests.helpers import eventually, run_tool

MiB = 1024 * 1024

#: A snippet that holds 64 MiB, burns CPU for a second (so the twice-a-second samples of
#: its tree see it), sleeps, and leaves 100 kB in its output folder.
BURN = """
import os, time
hold = bytearray(64 * 1024 * 1024)
for i in range(0, len(hold), 4096):
    hold[i] = 1
start = time.process_time()
while time.process_time() - start < 1.0:
    pass
# Under bwrap the CPU is the last of the samples taken twice a second of the live tree
# (docs/operate/sandbox.md): a sleep longer than two of their periods lets one land after
# the burn; 0.3 s let the last one fall before its end on a loaded machine (0.89 s seen).
time.sleep(1.2)
with open(os.path.join(os.environ["OUTPUT_DIR"], "data.bin"), "wb") as out:
    out.write(b"x" * 100_000)
print("done")
"""

_OWN_PYTHON = "python_receipt"

MODES = ["rlimits", pytest.param("bwrap", marks=pytest.mark.skipif(
    isolation_for(Settings.load()).mode != "bwrap",
    reason="bubblewrap isolation is not available on this machine"))]


class Reported(BaseModel):
    sent: int
    received: int


@tool()
async def reports_traffic(ctx: ToolContext, args: Reported) -> str:
    """Counts traffic it says it made, as a tool with its own network client would."""
    ctx.usage.add_network(sent=args.sent, received=args.received)
    return "reported"


def _registry() -> Registry:
    bundled = load_registry(bundled=True, entry_points=False)
    extra = spec_of(reports_traffic)
    assert extra is not None
    return Registry([*bundled.values(), extra])


@pytest.fixture
async def stub(make_server: ServerFactory
               ) -> AsyncIterator[tuple[StargrpcServer, tool_service_pb2_grpc.ToolServiceStub]]:
    server = await make_server(registry=_registry())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, tool_service_pb2_grpc.ToolServiceStub(channel)


async def _records(server: StargrpcServer) -> list[AuditRecord]:
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await eventually(lambda: audit.open_calls == 0, what="every open call's record written")
    await audit.writer.flush()
    return [r async for r in audit.writer.store.scan()]


def _observed(name: str, tool_name: str) -> float:
    return metrics.REGISTRY.get_sample_value(f"{name}_count", {"tool": tool_name}) or 0.0


@pytest.mark.parametrize("mode", MODES)
async def test_a_sandboxed_run_reports_the_cpu_memory_and_disk_of_its_process_tree(
        make_server: ServerFactory, mode: str) -> None:
    # The python tool under a name of its own: the metrics are the process's, and a run of
    # another test (a python run a test left ending) must not count in this one's series.
    python = dataclasses.replace(load_registry(bundled=True, entry_points=False)["python"],
                                 name=_OWN_PYTHON)
    server = await make_server(registry=Registry([python]), sandbox_isolation=mode)
    cpu_before = _observed("stargrpc_run_cpu_seconds", _OWN_PYTHON)
    memory_before = _observed("stargrpc_run_peak_memory_bytes", _OWN_PYTHON)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), _OWN_PYTHON,
                                {"code": BURN})

    result = events[-1].result
    usage = result.usage
    assert result.outcome == events_pb2.OUTCOME_OK, result.output
    # The command burns a second of its own CPU (time.process_time: user and system
    # together; how it splits depends on the machine — its clock reads are system calls).
    assert usage.cpu_user_seconds > 0
    assert usage.HasField("cpu_system_seconds")
    assert usage.cpu_user_seconds + usage.cpu_system_seconds > 0.9
    assert 64 * MiB <= usage.peak_rss_bytes < 1024 * MiB
    assert usage.wall_seconds >= 1.3  # the second of CPU and the sleep, at least
    assert usage.wall_seconds == pytest.approx(result.duration.ToNanoseconds() / 1e9)
    assert 100_000 <= usage.bytes_written < 200_000  # the file left; the snippet not
    assert not usage.HasField("network_bytes_sent")  # its network is not stargrpc's
    assert (usage.queued_seconds, usage.child_runs) == (0, 0)
    # One observation of each histogram for the run.
    assert _observed("stargrpc_run_cpu_seconds", _OWN_PYTHON) == cpu_before + 1
    assert _observed("stargrpc_run_peak_memory_bytes", _OWN_PYTHON) == memory_before + 1


async def test_an_in_process_run_reports_its_wall_time_and_leaves_cpu_and_memory_unset(
        stub) -> None:
    _, tools = stub
    cpu_before = _observed("stargrpc_run_cpu_seconds", "echo")
    events = await run_tool(tools, "echo", {"text": "hi"})

    usage = events[-1].result.usage
    assert events[-1].result.HasField("usage")
    assert usage.wall_seconds > 0
    assert usage.HasField("queued_seconds") and usage.queued_seconds == 0
    assert usage.HasField("child_runs") and usage.child_runs == 0
    for unmeasured in ("cpu_user_seconds", "cpu_system_seconds", "peak_rss_bytes",
                       "bytes_written", "network_bytes_sent", "network_bytes_received"):
        assert not usage.HasField(unmeasured), unmeasured
    assert _observed("stargrpc_run_cpu_seconds", "echo") == cpu_before  # nothing to observe


async def test_a_tool_counts_its_own_traffic_through_ctx_usage(stub) -> None:
    _, tools = stub
    events = await run_tool(tools, "reports_traffic", {"sent": 120, "received": 4096})

    usage = events[-1].result.usage
    assert (usage.network_bytes_sent, usage.network_bytes_received) == (120, 4096)
    assert not usage.HasField("cpu_user_seconds")


async def test_the_audit_record_keeps_the_receipt(stub) -> None:
    server, tools = stub
    events = await run_tool(tools, "reports_traffic", {"sent": 7, "received": 9})

    [record] = [r for r in await _records(server) if r.run_id == events[-1].run_id]
    kept = json.loads(record.usage)
    assert kept["wall_seconds"] == pytest.approx(events[-1].result.usage.wall_seconds)
    assert (kept["network_bytes_sent"], kept["network_bytes_received"]) == (7, 9)
    assert (kept["queued_seconds"], kept["child_runs"]) == (0, 0)
    assert "cpu_user_seconds" not in kept  # not measured, so not in the record either


async def test_the_sdk_reads_the_receipt_with_none_for_what_was_not_measured(stub) -> None:
    server, _ = stub
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        result = await AsyncClient(channel).call("reports_traffic",
                                                 {"sent": 1, "received": 2})

    assert isinstance(result.usage, Usage)
    assert result.usage.wall_seconds is not None and result.usage.wall_seconds > 0
    assert (result.usage.network_bytes_sent, result.usage.network_bytes_received) == (1, 2)
    assert result.usage.cpu_user_seconds is None and result.usage.cpu_seconds is None
    assert result.usage.peak_rss_bytes is None
    assert result.usage.child_runs == 0


def test_stargrpc_call_prints_the_receipt_above_the_outcome() -> None:
    event = events_pb2.RunEvent()
    event.result.outcome = events_pb2.OUTCOME_OK
    usage = event.result.usage
    usage.wall_seconds, usage.queued_seconds, usage.child_runs = 1.5, 0.0, 0
    usage.cpu_user_seconds, usage.cpu_system_seconds = 0.25, 0.5
    usage.peak_rss_bytes, usage.bytes_written = 60 * MiB, 12 * 1024
    out = io.StringIO()
    TextRenderer(out).render(event)

    assert out.getvalue().splitlines() == [
        "usage: wall 1.50s, cpu 0.75s (0.25s user + 0.50s system), peak memory 60.0 MiB, "
        "wrote 12.0 KiB",
        "= OK",
    ]


def test_a_fast_run_s_receipt_shows_milliseconds_not_zero_seconds() -> None:
    event = events_pb2.RunEvent()
    event.result.outcome = events_pb2.OUTCOME_OK
    usage = event.result.usage
    usage.wall_seconds, usage.queued_seconds = 0.00042, 0.0031
    usage.cpu_user_seconds, usage.cpu_system_seconds = 0.0003, 0.0
    out = io.StringIO()
    TextRenderer(out).render(event)

    assert out.getvalue().splitlines()[0] == (
        "usage: wall 0.4ms, queued 3.1ms, cpu 0.3ms (0.3ms user + 0s system)")


#: Burns CPU without end, saying so once it has burnt a second (by then the tree has been
#: sampled: twice a second).
BURN_FOREVER = """
import time
start = time.process_time()
said = False
while True:
    if not said and time.process_time() - start > 1.0:
        print("burning", flush=True)
        said = True
"""


@pytest.mark.parametrize("mode", MODES)
async def test_a_sandboxed_run_cancelled_mid_command_still_reports_its_cpu(
        make_server: ServerFactory, mode: str) -> None:
    server = await make_server(sandbox_isolation=mode)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        request = tool_service_pb2.ExecuteRequest(tool_name="python",
                                                  arguments_json=json.dumps(
                                                      {"code": BURN_FOREVER}))
        events = []
        async for response in stub.Execute(request):
            event = response.event
            events.append(event)
            if event.HasField("step") and "burning" in event.step.delta:
                await stub.CancelRun(tool_service_pb2.CancelRunRequest(
                    run_id=event.run_id, reason="enough"))

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_CANCELLED
    assert result.usage.cpu_user_seconds + result.usage.cpu_system_seconds > 0.5
    assert result.usage.peak_rss_bytes > 0
    assert not result.usage.HasField("bytes_written")  # not measured on a cancelled run
