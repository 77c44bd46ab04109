"""Sessions at their limits: CPU, disk, the wall clock, idle and total TTLs, and a custom
tool's ctx.session."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, eventually, run_tool
from tests.sessions.session_helpers import create, open_sessions, python, reason

SESSION_TOOLS = Path(__file__).parent / "session_tools"


async def serve(make_server, **settings):
    server = await make_server(**{"sandbox_max_processes": 32, **settings})
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return channel, tool_service_pb2_grpc.ToolServiceStub(channel)


@pytest.mark.parametrize("isolation", ["auto", "unshare"])
async def test_the_cpu_limit_kills_the_interpreter_and_the_call_is_session_lost(
        make_server, isolation) -> None:
    # Under unshare the interpreter is its PID namespace's init: the limit still holds.
    channel, stub = await serve(make_server, session_cpu_seconds=1,
                                sandbox_isolation=isolation)
    async with channel:
        session_id = await create(stub)
        result = await python(stub, session_id, "while True:\n    pass")
        assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_FAILED,
                                                       "SESSION_LOST")
        # Said by the signal (bubblewrap passes it on) or by the CPU time the server saw
        # the tree use (unshare reports an exit status of its own).
        message = result.error.message
        assert "CPU time limit of 1 s" in message or "SIGXCPU" in message, message
        assert "closed" in message
        assert await open_sessions(stub) == []
        # The server serves on, and a new session works.
        fresh = await create(stub)
        assert as_dict(await python(stub, fresh, "'ok'"))["structured_output"] == "ok"


async def test_a_call_that_fills_the_disk_and_ends_at_once_loses_the_session(
        make_server) -> None:
    # Faster than the folder's watch looks: the call that went over the cap is the one that
    # ends SESSION_LOST (it had ended OK, and the next call too).
    channel, stub = await serve(make_server, session_disk_mb=8)
    async with channel:
        session_id = await create(stub)
        result = await python(stub, session_id, "open('big', 'wb').write(b'x' * 12 * 2**20)")
        assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_FAILED,
                                                       "SESSION_LOST"), result
        assert "disk limit of 8 MB exceeded" in result.error.message
        assert await open_sessions(stub) == []


async def test_a_session_over_its_disk_cap_is_closed(make_server) -> None:
    channel, stub = await serve(make_server, session_disk_mb=8)
    async with channel:
        session_id = await create(stub)
        code = ("import time\nfor i in range(6):\n"
                "    open(f'f{i}', 'wb').write(b'x' * 2 * 1024 * 1024)\n"
                "time.sleep(60)")
        result = await python(stub, session_id, code)
        assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_FAILED,
                                                       "SESSION_LOST")
        assert "disk limit of 8 MB exceeded" in result.error.message


async def test_the_wall_clock_interrupts_the_call_and_the_session_lives_on(
        make_server) -> None:
    channel, stub = await serve(make_server, sandbox_wall_clock_seconds=1)
    async with channel:
        session_id = await create(stub)
        result = await python(stub, session_id, "x = 1\nimport time\ntime.sleep(60)")
        assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_TIMEOUT,
                                                       "WALL_CLOCK_LIMIT")
        assert "KeyboardInterrupt" in result.output
        assert as_dict(await python(stub, session_id, "x"))["structured_output"] == 1
        # Code that swallows the interrupt loses its session.
        stubborn = ("import time\nwhile True:\n    try:\n        time.sleep(60)\n"
                    "    except KeyboardInterrupt:\n        pass")
        result = await python(stub, session_id, stubborn)
        assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_FAILED,
                                                       "SESSION_LOST")
        assert "did not stop" in result.error.message


async def test_idle_and_total_ttls_close_a_session(make_server) -> None:
    channel, stub = await serve(make_server)
    async with channel:
        idle = await create(stub, idle_seconds=1)
        short = await create(stub, ttl_seconds=2)
        await eventually(lambda: _gone(stub, idle))
        await eventually(lambda: _gone(stub, short))
        for session_id in (idle, short):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await python(stub, session_id, "1")
            assert reason(caught.value) == "SESSION_NOT_FOUND"


async def _gone(stub, session_id: str) -> bool:
    return session_id not in await open_sessions(stub)


async def test_sessions_can_be_turned_off(make_server) -> None:
    channel, stub = await serve(make_server, session_max_per_principal=0)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await create(stub)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason(caught.value) == "SESSION_LIMIT"


async def test_a_custom_tool_gets_ctx_session(make_server) -> None:
    channel, stub = await serve(make_server, tools_dir=[SESSION_TOOLS])
    async with channel:
        session_id = await create(stub)
        events = await run_tool(stub, "session_note", {"text": "from a tool"},
                                session_id=session_id)
        result = events[-1].result
        assert as_dict(result)["structured_output"] == {
            "session_id": session_id, "kind": "python", "read_back": "from a tool"}
        read = await python(stub, session_id, "open('note.txt').read()")
        assert as_dict(read)["structured_output"] == "from a tool"
        outside = (await run_tool(stub, "session_note", {"text": "x"}))[-1].result
        assert as_dict(outside)["structured_output"] == {"session_id": None}


async def test_a_custom_tool_never_follows_a_symlink_the_session_planted(make_server,
                                                                         tmp_path) -> None:
    channel, stub = await serve(make_server, tools_dir=[SESSION_TOOLS])
    target = tmp_path / "server-file"
    target.write_text("the server's own")
    async with channel:
        session_id = await create(stub)
        planted = await python(stub, session_id,
                               f"import os\nos.symlink({str(target)!r}, 'note.txt')")
        assert planted.outcome == events_pb2.OUTCOME_OK, planted
        events = await run_tool(stub, "session_note", {"text": "overwritten?"},
                                session_id=session_id)
        assert as_dict(events[-1].result)["structured_output"] == {
            "session_id": session_id, "refused": "OSError"}
        assert target.read_text() == "the server's own"


@pytest.mark.parametrize("isolation", ["unshare", "rlimits"])
async def test_sessions_work_in_the_other_isolation_modes(make_server, isolation) -> None:
    channel, stub = await serve(make_server, sandbox_isolation=isolation,
                                sandbox_allow_weak_isolation=True,
                                sandbox_wall_clock_seconds=2)
    async with channel:
        session_id = await create(stub)
        await python(stub, session_id, "import os\nkept = os.getpid()")
        assert as_dict(await python(stub, session_id, "kept == os.getpid()"))[
            "structured_output"] is True
        bomb = await python(stub, session_id, "while True:\n    os.fork()")
        assert (bomb.outcome, bomb.error.code) == (events_pb2.OUTCOME_FAILED,
                                                   "PYTHON_EXCEPTION")
        after = await python(stub, session_id, "'alive'")
        assert as_dict(after)["structured_output"] == "alive"
        # The wall clock interrupts a call here too (under unshare the kernel is PID 1).
        slow = await python(stub, session_id, "import time\ntime.sleep(60)")
        assert (slow.outcome, slow.error.code) == (events_pb2.OUTCOME_TIMEOUT,
                                                   "WALL_CLOCK_LIMIT")
        assert as_dict(await python(stub, session_id, "kept == os.getpid()"))[
            "structured_output"] is True


async def test_a_cancelled_call_that_will_not_stop_is_cancelled_and_closes_its_session(
        make_server) -> None:
    channel, stub = await serve(make_server)
    async with channel:
        session_id = await create(stub)
        # Deaf to the interrupt from its first line on (a try around the sleep alone leaves
        # the loop's own lines between two sleeps open to it).
        stubborn = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                    "print('started', flush=True)\nwhile True:\n    time.sleep(60)")
        started = await stub.StartRun(tool_service_pb2.StartRunRequest(
            tool_name="python", arguments_json=json.dumps({"code": stubborn}),
            session_id=session_id))
        events = stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=started.run_id))
        seen = []
        async for response in events:
            seen.append(response.event)
            if response.event.step.delta == "started\n":
                await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=started.run_id))
        assert seen[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
        # The interpreter is interrupted, given its grace, then killed and its sandbox taken
        # down: seconds on a busy machine.
        await eventually(lambda: _gone(stub, session_id), within=30, interval=0.05,
                         what="the stubborn session closed")
        # A call that does stop when cancelled leaves its session alive.
        kept = await create(stub)
        started = await stub.StartRun(tool_service_pb2.StartRunRequest(
            tool_name="python", arguments_json=json.dumps(
                {"code": "import time\nprint('started', flush=True)\ntime.sleep(60)"}),
            session_id=kept))
        async for response in stub.WatchRun(tool_service_pb2.WatchRunRequest(
                run_id=started.run_id)):
            if response.event.step.delta == "started\n":
                await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=started.run_id))
        assert as_dict(await python(stub, kept, "'still here'"))[
            "structured_output"] == "still here"


async def test_stopping_the_server_ends_session_calls_and_closes_sessions(make_server
                                                                          ) -> None:
    server = await make_server(sandbox_max_processes=32)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        session_id = await create(stub)
        [held] = list(server.service.sessions)
        assert held.session_id == session_id
        folder = held.folder
        call = stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="python", arguments_json=json.dumps(
                {"code": "import time\nprint('started', flush=True)\ntime.sleep(60)"}),
            session_id=session_id))
        async for response in call:
            if response.event.step.delta == "started\n":
                break
        await server.stop(grace=0.5)
        assert len(server.service.sessions) == 0
        assert not folder.exists()  # its folder went with it


async def test_a_silent_call_heartbeats_while_it_runs(make_server) -> None:
    channel, stub = await serve(make_server)
    async with channel:
        session_id = await create(stub)
        # Longer than one tick (5 s) of the session call: a heartbeat says it is alive.
        events = await run_tool(stub, "python", {"code": "import time\ntime.sleep(5.5)"},
                                session_id=session_id)
        beats = [e.heartbeat for e in events if e.HasField("heartbeat")]
        assert beats and beats[0].message.startswith("running for ")
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
