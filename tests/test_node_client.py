"""The contract from another language: the Node.js client in clients/node/ (grpc-js with
stubs loaded from protos/) against a real server, asserting the event sequences the Python
tests assert. Its npm dependencies are installed from the committed lock file when missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import grpc

from stargrpc.errors import ResourceExhausted
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.client.faults import Proxy, Recorder
from tests.client.garbled import BAD_ERROR_INFO, TRUNCATED, garbled_server
from tests.client_builds import NODE_DIR, json_events, run_node
from tests.helpers import COUNT_TO_3, count_phases, phases, run_tool
from tests.runs_support import collect

TIMEOUT = 60


async def test_node_lists_tools_and_streams_the_same_events_as_python(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        node_cli: list[str]) -> None:
    target = f"127.0.0.1:{server.port}"

    code, out, _ = await run_node(node_cli, "tools", "--json", "--target", target)
    assert code == 0
    catalog = json.loads(out)
    assert catalog["catalog_hash"] == server.runtime.registry.catalog_hash
    assert {"count", "echo", "sleep"} <= {t["name"] for t in catalog["tools"]}

    code, out, _ = await run_node(node_cli, "call", "count", '{"to": 3}', "--json",
                               "--target", target)
    from_node = json_events(out)
    from_python = await run_tool(stub, "count", {"to": 3})

    assert code == 0
    assert phases(from_node) == phases(from_python) == COUNT_TO_3
    assert [e.seq for e in from_node] == list(range(1, len(from_node) + 1))
    assert from_node[-1].result.output == from_python[-1].result.output == "counted to 3"

    code, _, err = await run_node(node_cli, "call", "no_such_tool", "--target", target)
    assert code == 1 and "NOT_FOUND" in err


async def test_node_watch_replays_a_run_after_a_seq(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        node_cli: list[str]) -> None:
    call = stub.Execute(tool_service_pb2.ExecuteRequest(
        tool_name="count", arguments_json='{"to": 4, "delay": 0.05}', idempotency_key="k1"))
    first = [(await call.read()).event, (await call.read()).event]

    code, out, _ = await run_node(node_cli, "watch", first[0].run_id, "--after-seq", "2",
                               "--json", "--target", f"127.0.0.1:{server.port}")
    rest = []
    while (response := await call.read()) is not grpc.aio.EOF:
        rest.append(response.event)

    assert code == 0
    assert json_events(out) == rest  # the very same events, field for field
    assert phases(first + rest) == count_phases(4)


async def test_node_resumes_a_broken_stream_through_watch_run(
        make_server, node_cli: list[str]) -> None:
    recorder = Recorder()
    server = await make_server(interceptors=[recorder])
    proxy = Proxy(server.port)
    await proxy.start()
    proc = await asyncio.create_subprocess_exec(
        *node_cli, "call", "count", '{"to": 6, "delay": 0.1}', "--json",
        "--target", proxy.target, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        lines = []
        while len(lines) < 2:
            lines.append(await asyncio.wait_for(proc.stdout.readline(), TIMEOUT))
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
    assert recorder.seen("WatchRun"), "the Node client resumed through WatchRun"


async def test_node_cli_usage_errors_are_clear_and_exit_two(node_cli: list[str]) -> None:
    code, out, _ = await run_node(node_cli, "--help")
    assert code == 0
    assert out.startswith("usage: cli.js tools")

    code, _, err = await run_node(node_cli, "--no-such-option")
    assert code == 2
    assert "Unknown option '--no-such-option'" in err and "usage:" in err

    code, _, err = await run_node(node_cli, "call", "echo", '{"text": ')
    assert code == 2
    assert "ARGS_JSON is not valid JSON" in err


async def test_node_cli_ends_quietly_when_its_reader_stops_early(
        server: StargrpcServer, node_cli: list[str]) -> None:
    # As `… --json | head -1`: the reader closes the pipe after one line.
    read_end, write_end = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        *node_cli, "call", "count", '{"to": 50, "delay": 0.02}', "--json",
        "--target", f"127.0.0.1:{server.port}", stdout=write_end,
        stderr=asyncio.subprocess.PIPE)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        first = await asyncio.to_thread(reader.readline)
    _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)

    assert json.loads(first)["seq"] == "1"
    assert proc.returncode == 0
    assert err == b""


async def test_node_watch_at_or_past_the_end_of_a_finished_run_exits_zero(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        node_cli: list[str]) -> None:
    executed = await run_tool(stub, "count", {"to": 2})
    run_id, last = executed[0].run_id, len(executed)
    target = f"127.0.0.1:{server.port}"

    # Bounded well below TIMEOUT: a client that waits for a Result that never comes hangs.
    (code, out, err), (tail_code, tail, _) = await asyncio.wait_for(asyncio.gather(
        run_node(node_cli, "watch", run_id, "--after-seq", str(last), "--target", target),
        run_node(node_cli, "watch", run_id, "--after-seq", str(last - 1), "--json",
              "--target", target)), 20)

    assert (code, out) == (0, "")
    assert f"run {run_id} has ended: nothing follows seq {last}" in err
    assert tail_code == 0
    assert json_events(tail) == executed[-1:]


async def test_node_ctrl_c_during_call_cancels_the_run(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        node_cli: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(
        *node_cli, "call", "sleep", '{"seconds": 60, "heartbeat_every": 0.05}', "--json",
        "--target", f"127.0.0.1:{server.port}", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
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

    assert proc.returncode == 130
    assert f"interrupted; run {first['run_id']} cancelled" in err.decode()
    assert watched[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert watched[-1].result.error.message == "interrupted from the command line"


async def test_node_shows_field_violations_cancels_and_renders_run_ids(
        make_server, node_cli: list[str]) -> None:
    server = await make_server(list_tools_show_uncallable=True)
    target = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        running = tool_service_pb2_grpc.ToolServiceStub(channel).Execute(
            tool_service_pb2.ExecuteRequest(tool_name="sleep", idempotency_key="sleepy",
                                            arguments_json='{"seconds": 60}'))
        run_id = (await running.read()).event.run_id

        (bad, _, bad_err), (cancel, _, cancel_err), (echo, echoed, echo_err), \
            (tools, listed, _) = await asyncio.gather(
                run_node(node_cli, "call", "count", '{"to": "many"}', "--target", target),
                run_node(node_cli, "cancel", run_id, "--reason", "from node", "--target", target),
                run_node(node_cli, "call", "echo", '{"text": "hello there"}', "--target", target),
                run_node(node_cli, "tools", "--target", target))
        rest = await collect(running)
        again, _, again_err = await run_node(node_cli, "cancel", run_id, "--target", target)

    assert bad == 1
    assert "INVALID_ARGUMENT" in bad_err and "[INVALID_ARGUMENT]" in bad_err
    assert "\n  arguments.to: " in bad_err  # the BadRequest field violation, decoded
    assert (cancel, cancel_err.strip()) == (0, "cancelled")
    assert rest[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert rest[-1].result.error.message == "from node"
    assert (again, again_err.strip()) == (2, "already ended")
    assert echo == tools == 0
    assert echo_err.startswith("run ")  # the run id, as `stargrpc call` shows it
    assert echoed.count("hello there") == 1  # streamed as a delta, not printed again
    lines = {line.split()[0]: line for line in listed.splitlines()}
    assert "[privileged]" in lines["shell"]
    assert "[privileged]" not in lines["echo"] and "[not allowed]" not in lines["echo"]


def _node_docs_snippets() -> tuple[list[str], list[str]]:
    """The Node.js page of the docs: its ```js blocks and its `node clients/node/cli.js`
    command lines."""
    section = (NODE_DIR.parent.parent / "docs" / "use" / "node.md").read_text()
    scripts = re.findall(r"```js\n(.*?)```", section, re.S)
    commands = [line.split("  #")[0].strip()
                for block in re.findall(r"```sh\n(.*?)```", section, re.S)
                for line in block.splitlines() if line.startswith("node clients/node/cli.js")]
    return scripts, commands


async def test_every_node_snippet_of_the_docs_runs_as_written(
        make_server, node_cli: list[str]) -> None:
    server = await make_server()
    target = f"127.0.0.1:{server.port}"
    scripts, commands = _node_docs_snippets()
    assert scripts and len(commands) >= 4
    async with grpc.aio.insecure_channel(target) as channel:
        running = tool_service_pb2_grpc.ToolServiceStub(channel).Execute(
            tool_service_pb2.ExecuteRequest(tool_name="sleep", idempotency_key="readme",
                                            arguments_json='{"seconds": 60}'))
        run_id = (await running.read()).event.run_id
        env = {**os.environ, "STARGRPC_TARGET": target, "STARGRPC_API_KEY": ""}
        root = str(NODE_DIR.parent.parent)
        shells = [command.replace("<run-id>", run_id).replace(
            "--target localhost:50051", f"--target {target}") for command in commands]
        # All at once: `watch` follows the run until `cancel` ends it. From the repository
        # root, as the docs say.
        ran = await asyncio.gather(
            *(_run_in(root, env, node_cli[0], "-e", script) for script in scripts),
            *(_run_in(root, env, "bash", "-c", shell) for shell in shells))
        results = [(snippet, *outcome) for snippet, outcome in zip([*scripts, *commands], ran,
                                                                   strict=True)]
        await collect(running)

    for snippet, code, _, err in results:
        if " steer " in snippet and code == 1 and "RUN_FINISHED" in err:
            continue  # ran after `cancel` ended the run: refused as it must be
        assert code in (0, 7), f"{snippet}\nexit {code}\n{err}"  # 7: watch saw the cancel
        assert "Error" not in err, f"{snippet}\n{err}"
    script_out = results[0][2]
    assert "count" in script_out.splitlines()[0] and "counted to 3" in script_out


async def _run_in(cwd: str, env: dict[str, str], *argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_node_steers_a_live_run_and_is_refused_a_finished_one(
        make_server, node_cli: list[str]) -> None:
    server = await make_server()
    target = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        running = stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="sleep", arguments_json='{"seconds": 60}'))
        run_id = (await running.read()).event.run_id
        steered = await run_node(node_cli, "steer", run_id, "wrap it up", "--target", target)
        await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id))
        events = await collect(running)
        late, _, late_err = await run_node(node_cli, "steer", run_id, "too late", "--target",
                                        target)

    assert (steered[0], steered[2].strip()) == (0, "steered")
    notices = [e.notice for e in events if e.HasField("notice") and e.notice.code == "STEERED"]
    assert [n.message for n in notices] == ["wrap it up"]
    assert late == 1 and "RUN_FINISHED" in late_err


async def test_node_ends_a_delta_s_unfinished_line_before_the_next_one(
        server, node_cli: list[str]) -> None:
    code, out, _ = await run_node(node_cli, "call", "echo", '{"text": "no newline"}',
                               "--target", f"127.0.0.1:{server.port}")

    assert code == 0
    assert "no newline\n✓ echo" in out  # not "no newline✓ echo"


async def test_node_hangs_a_call_under_a_parent_run(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        node_cli: list[str]) -> None:
    holding = stub.Execute(tool_service_pb2.ExecuteRequest(
        tool_name="count", arguments_json='{"to": 100, "delay": 0.1}'))
    parent = (await holding.read()).event.run_id
    target = f"127.0.0.1:{server.port}"

    code, out, _ = await run_node(node_cli, "call", "echo", '{"text": "under"}', "--json",
                                  "--parent-run-id", parent, "--target", target)
    events = json_events(out)
    assert code == 0 and events[-1].result.output == "under"
    assert (events[0].parent_run_id, events[0].root_run_id) == (parent, parent)
    code, _, err = await run_node(node_cli, "call", "echo", '{"text": "x"}',
                                  "--parent-run-id", "0" * 32, "--target", target)
    assert code == 1 and "NOT_FOUND" in err
    holding.cancel()


async def test_node_notices_a_connection_gone_silent_and_resumes_the_run(
        make_server, node_cli: list[str]) -> None:
    # No deadline: only the channel's keepalive tells a silent server from a slow run
    # (there was none, and such a call waited for ever).
    recorder = Recorder()
    server = await make_server(interceptors=[recorder])
    proxy = Proxy(server.port)
    await proxy.start()
    proc = await asyncio.create_subprocess_exec(
        *node_cli, "call", "count", '{"to": 6, "delay": 0.1}', "--json",
        "--target", proxy.target, stdout=asyncio.subprocess.PIPE)
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


async def test_node_retries_a_refusal_with_retry_info_after_its_delay(
        make_server, node_cli: list[str]) -> None:
    recorder = Recorder()
    server = await make_server(interceptors=[recorder])
    target = ("--target", f"127.0.0.1:{server.port}")
    recorder.fail("Execute", ResourceExhausted("busy", retry_after=0.3,
                                               reason="CONCURRENCY_LIMIT"))

    # Retried once the delay passed, as in Python and Go (it was refused at once).
    code, out, _ = await run_node(node_cli, "call", "echo", '{"text": "x"}', *target)
    assert code == 0 and "x" in out
    first, again = recorder.seen("Execute")
    assert again.request.idempotency_key == first.request.idempotency_key

    # Neither LANE_BUSY nor a delay past the bound is waited for.
    recorder.fail("Execute", ResourceExhausted("busy", retry_after=3600,
                                               reason="CONCURRENCY_LIMIT"))
    code, _, err = await asyncio.wait_for(
        run_node(node_cli, "call", "echo", '{"text": "x"}', *target), 20)
    assert code == 1 and "retry after 3600s" in err
    recorder.fail("Execute", ResourceExhausted("busy", retry_after=0.1, reason="LANE_BUSY"))
    code, _, err = await run_node(node_cli, "call", "echo", '{"text": "x"}', *target)
    assert code == 1 and "[LANE_BUSY]" in err
    assert len(recorder.seen("Execute")) == 4


async def test_node_reports_a_refusal_whose_details_do_not_read(node_cli: list[str]) -> None:
    for details in (TRUNCATED, BAD_ERROR_INFO):
        async with garbled_server(details) as target:
            code, _, err = await run_node(node_cli, "tools", "--target", target)
        assert code == 1 and err.startswith("error: NOT_FOUND: nope"), err
    assert "tool_name: unknown" in err  # what reads is kept
