"""The contract from Go: clients/go/ built offline in GOPATH mode over Debian's Go
libraries (clients/go/gopath.sh), its unit tests, and its command line against a real
server: the same events as the Python client, resume after a cut, rich errors, the end of
a run, Ctrl-C cancelling the run, and the checked-in stubs being current."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
from pathlib import Path

import grpc
import pytest

from stargrpc.errors import ResourceExhausted
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.client.faults import Proxy, Recorder
from tests.client.garbled import BAD_ERROR_INFO, TRUNCATED, garbled_server
from tests.client_builds import GO_DIR, GO_PACKAGE, go, json_events, run_go
from tests.conftest import AuthServerFactory, ServerFactory
from tests.helpers import COUNT_TO_3, count_phases, key_channel, phases, run_tool
from tests.runs_support import collect

TIMEOUT = 60


def test_go_vet_and_unit_tests_pass() -> None:
    packages = [f"{GO_PACKAGE}/{name}" for name in
                ("stargrpcv1", "stargrpc", "cmd/stargrpc-go", "cmd/stargrpc-conformance")]
    vetted = go("vet", *packages)
    assert vetted.returncode == 0, vetted.stderr
    tested = go("test", f"{GO_PACKAGE}/stargrpc")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    unformatted = subprocess.run(["gofmt", "-l", str(GO_DIR)], capture_output=True, text=True,
                                 check=True, timeout=TIMEOUT)
    assert unformatted.stdout == ""


def test_the_checked_in_go_stubs_are_current(tmp_path: Path) -> None:
    for tool in ("protoc", "protoc-gen-go", "protoc-gen-go-grpc"):
        if shutil.which(tool) is None:
            pytest.fail(f"regenerating the Go stubs needs {tool} (see clients/go/gen.sh)")
    subprocess.run(["bash", str(GO_DIR / "gen.sh"), str(tmp_path)], check=True,
                   timeout=TIMEOUT)
    checked_in = sorted(p.name for p in (GO_DIR / "stargrpcv1").glob("*.go"))
    assert sorted(p.name for p in tmp_path.glob("*.go")) == checked_in
    for name in checked_in:
        assert (tmp_path / name).read_text() == (GO_DIR / "stargrpcv1" / name).read_text(), name


async def test_go_lists_tools_and_streams_the_same_events_as_python(
        make_auth_server: AuthServerFactory, go_cli: str) -> None:
    auth = await make_auth_server(list_tools_show_uncallable=True)
    common = ("-target", auth.target, "-api-key", auth.key)

    code, out, _ = await run_go(go_cli, *common, "-json", "tools")
    assert code == 0
    assert json.loads(out)["catalogHash"] == auth.server.runtime.registry.catalog_hash
    code, listed, _ = await run_go(go_cli, *common, "tools")
    lines = {line.split()[0]: line for line in listed.splitlines()}
    assert "[privileged]" in lines["shell"] and "[privileged]" not in lines["echo"]

    code, out, err = await run_go(go_cli, *common, "-json", "call", "count", '{"to": 3}')
    from_go = json_events(out)
    async with key_channel(auth.target, auth.key) as channel:
        from_python = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel),
                                     "count", {"to": 3})

    assert code == 0
    assert err == f"run {from_go[0].run_id}\n"
    assert phases(from_go) == phases(from_python) == COUNT_TO_3
    assert [e.seq for e in from_go] == list(range(1, len(from_go) + 1))
    assert from_go[-1].result.output == "counted to 3"

    code, _, err = await run_go(go_cli, "-target", auth.target, "-api-key", "wrong", "tools")
    assert code == 1 and err.startswith("UNAUTHENTICATED: ")


async def test_go_shows_the_reason_and_each_field_violation(
        server: StargrpcServer, go_cli: str) -> None:
    target = ("-target", f"127.0.0.1:{server.port}")

    (bad, _, bad_err), (unknown, _, unknown_err) = await asyncio.gather(
        run_go(go_cli, *target, "call", "count", '{"to": "many"}'),
        run_go(go_cli, *target, "call", "no_such_tool"))

    assert bad == 1
    assert bad_err.startswith("INVALID_ARGUMENT: ") and "[INVALID_ARGUMENT]" in bad_err
    assert "\n  arguments.to: " in bad_err
    assert unknown == 1 and unknown_err.startswith("NOT_FOUND: ")
    assert "[TOOL_NOT_FOUND]" in unknown_err


async def test_go_resumes_a_broken_stream_through_watch_run(
        make_server: ServerFactory, go_cli: str) -> None:
    recorder = Recorder()
    server = await make_server(interceptors=[recorder])
    proxy = Proxy(server.port)
    await proxy.start()
    proc = await asyncio.create_subprocess_exec(
        go_cli, "-target", proxy.target, "-json", "call", "count", '{"to": 6, "delay": 0.1}',
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        lines = [await asyncio.wait_for(proc.stdout.readline(), TIMEOUT) for _ in range(2)]
        proxy.cut()  # the network fails mid-run; the server does not notice
        rest, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    finally:
        await proxy.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    events = json_events(b"".join(lines).decode() + rest.decode())
    assert proc.returncode == 0
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert phases(events) == count_phases(6)
    assert len(recorder.seen("Execute")) == 1
    assert recorder.seen("WatchRun"), "the Go client resumed through WatchRun"


async def test_go_watch_at_or_past_the_end_of_a_finished_run_exits_zero(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        go_cli: str) -> None:
    executed = await run_tool(stub, "count", {"to": 2})
    run_id, last = executed[0].run_id, len(executed)
    target = ("-target", f"127.0.0.1:{server.port}")

    (code, out, err), (tail_code, tail, _) = await asyncio.wait_for(asyncio.gather(
        run_go(go_cli, *target, "watch", "-after-seq", str(last), run_id),
        run_go(go_cli, *target, "-json", "watch", "-after-seq", str(last - 1), run_id)), 20)

    assert (code, out) == (0, "")
    assert f"run {run_id} has ended: nothing follows seq {last}" in err
    assert tail_code == 0
    assert json_events(tail) == executed[-1:]


async def test_go_ctrl_c_during_call_cancels_the_run_and_cancel_says_it_ended(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        go_cli: str) -> None:
    target = ("-target", f"127.0.0.1:{server.port}")
    proc = await asyncio.create_subprocess_exec(
        go_cli, *target, "-json", "call", "sleep", '{"seconds": 60, "heartbeat_every": 0.05}',
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), TIMEOUT))
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    watched = await asyncio.wait_for(collect(stub.WatchRun(
        tool_service_pb2.WatchRunRequest(run_id=first["run_id"]))), TIMEOUT)
    again, _, again_err = await run_go(go_cli, *target, "cancel", first["run_id"])

    assert proc.returncode == 130
    assert f"run {first['run_id']} cancelled" in err.decode()
    assert watched[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert watched[-1].result.error.message == "the caller's context was cancelled"
    assert (again, again_err.strip()) == (2, "already ended")


async def test_go_steers_a_live_run_and_is_refused_a_finished_one(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        go_cli: str) -> None:
    target = ("-target", f"127.0.0.1:{server.port}")
    running = stub.Execute(tool_service_pb2.ExecuteRequest(
        tool_name="sleep", arguments_json='{"seconds": 60}'))
    run_id = (await running.read()).event.run_id

    steered = await run_go(go_cli, *target, "steer", run_id, "wrap it up")
    await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id))
    events = await asyncio.wait_for(collect(running), TIMEOUT)
    late, _, late_err = await run_go(go_cli, *target, "steer", run_id, "too late")

    assert (steered[0], steered[2].strip()) == (0, "steered")
    notices = [e.notice for e in events if e.HasField("notice") and e.notice.code == "STEERED"]
    assert [n.message for n in notices] == ["wrap it up"]
    assert late == 1 and "RUN_FINISHED" in late_err


async def test_go_hangs_a_call_under_a_parent_run(server: StargrpcServer, go_cli: str) -> None:
    target = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        holding = stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="count", arguments_json='{"to": 100, "delay": 0.1}'))
        parent = (await holding.read()).event.run_id
        code, out, _ = await run_go(go_cli, "-target", target, "-json", "call",
                                    "-parent-run-id", parent, "echo", '{"text": "under"}')
        events = json_events(out)
        assert code == 0 and events[-1].result.output == "under"
        assert (events[0].parent_run_id, events[0].root_run_id) == (parent, parent)
        code, _, err = await run_go(go_cli, "-target", target, "call",
                                    "-parent-run-id", "0" * 32, "echo", '{"text": "x"}')
        assert code == 1 and "RUN_NOT_FOUND" in err
        holding.cancel()


async def test_go_returns_a_refusal_whose_retry_delay_is_past_its_bound_at_once(
        make_server: ServerFactory, go_cli: str) -> None:
    recorder = Recorder()
    server = await make_server(interceptors=[recorder])
    target = ("-target", f"127.0.0.1:{server.port}")
    recorder.fail("Execute", ResourceExhausted("busy", retry_after=3600,
                                               reason="CONCURRENCY_LIMIT"))

    # An hour's RetryInfo is not waited for (it was: the call hung for the hour).
    code, _, err = await asyncio.wait_for(
        run_go(go_cli, *target, "call", "echo", '{"text": "x"}'), 20)
    assert code == 1 and "[CONCURRENCY_LIMIT]" in err and "3600" in err
    assert len(recorder.seen("Execute")) == 1

    # A short one still is, and the retry runs the tool.
    recorder.fail("Execute", ResourceExhausted("busy", retry_after=0.05,
                                               reason="CONCURRENCY_LIMIT"))
    code, out, _ = await asyncio.wait_for(
        run_go(go_cli, *target, "call", "echo", '{"text": "x"}'), 20)
    assert code == 0 and "x" in out
    assert len(recorder.seen("Execute")) == 3


async def test_go_notices_a_connection_gone_silent_and_resumes_the_run(
        make_server: ServerFactory, go_cli: str) -> None:
    # No deadline: only the connection's keepalive tells a silent server from a slow run
    # (there was none, and such a call waited for ever).
    recorder = Recorder()
    server = await make_server(interceptors=[recorder])
    proxy = Proxy(server.port)
    await proxy.start()
    proc = await asyncio.create_subprocess_exec(
        go_cli, "-target", proxy.target, "-json", "call", "count", '{"to": 6, "delay": 0.1}',
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        lines = [await asyncio.wait_for(proc.stdout.readline(), TIMEOUT) for _ in range(2)]
        proxy.stall()  # a stopped server: nothing more arrives, nothing closes
        rest, _ = await asyncio.wait_for(proc.communicate(), 90)
    finally:
        await proxy.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    events = json_events(b"".join(lines).decode() + rest.decode())
    assert proc.returncode == 0
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert phases(events) == count_phases(6)
    assert len(recorder.seen("Execute")) == 1
    watches = recorder.seen("WatchRun")
    assert len(watches) == 1 and watches[0].request.after_seq >= 2


async def test_go_reports_a_refusal_whose_details_do_not_read(go_cli: str) -> None:
    # grpc-go's transport turns a Status that does not read into INTERNAL itself.
    async with garbled_server(TRUNCATED) as target:
        code, _, err = await run_go(go_cli, "-target", target, "tools")
    assert code == 1 and err.startswith("INTERNAL: transport: malformed grpc-status-details-bin")
    async with garbled_server(BAD_ERROR_INFO) as target:
        code, _, err = await run_go(go_cli, "-target", target, "tools")
    assert code == 1 and err.startswith("NOT_FOUND: nope"), err
    assert "tool_name: unknown" in err  # what reads is kept
