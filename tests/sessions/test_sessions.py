"""Sessions through a real server and real sandboxes: state that persists, caps, ownership,
and code that tries to break out of its session."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, eventually, key_channel, run_tool, status_details
from tests.sessions.session_helpers import create, python, reason

#: Small limits keep the abuse tests quick.
LIMITS = {"sandbox_max_processes": 32, "sandbox_wall_clock_seconds": 30,
          "session_cpu_seconds": 20, "session_memory_mb": 256, "session_disk_mb": 16,
          "session_max_per_principal": 3, "session_max_total": 5}


@pytest.fixture
async def auth(make_auth_server):
    return await make_auth_server(roles=("admin", "privileged"), **LIMITS)


@pytest.fixture
async def stub(auth):
    async with key_channel(auth.target, auth.key) as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


async def test_a_python_session_keeps_its_interpreter_and_files(stub) -> None:
    session_id = await create(stub)

    first = await python(stub, session_id,
                         "import json\nrows = [1, 2, 3]\n"
                         "open('data.txt', 'w').write('kept')\nprint('loaded')")
    assert first.outcome == events_pb2.OUTCOME_OK, first
    assert first.output == "loaded"
    second = await python(stub, session_id,
                          "def total(xs):\n    return sum(xs)\n"
                          "{'total': total(rows), 'file': open('data.txt').read(), "
                          "'json': json.dumps(rows)}")
    assert second.outcome == events_pb2.OUTCOME_OK, second
    assert as_dict(second)["structured_output"] == {"total": 6, "file": "kept",
                                                    "json": "[1, 2, 3]"}
    third = await python(stub, session_id, "class Thing: pass\nThing()")
    assert as_dict(third)["structured_output"].startswith("<__main__.Thing object")


async def test_each_call_streams_its_output_as_deltas(stub) -> None:
    session_id = await create(stub)
    events = await run_tool(stub, "python", {"code": "import sys\nfor i in range(3):\n"
                                             "    print(i)\nprint('oops', file=sys.stderr)"},
                            session_id=session_id)
    out = "".join(e.step.delta for e in events if e.HasField("step")
                  and e.step.phase == events_pb2.STEP_PHASE_DELTA
                  and e.step.channel == "stdout")
    err = "".join(e.step.delta for e in events if e.HasField("step")
                  and e.step.phase == events_pb2.STEP_PHASE_DELTA
                  and e.step.channel == "stderr")
    assert (out, err) == ("0\n1\n2\n", "oops\n")
    assert all(e.step.delta.endswith("\n") for e in events if e.HasField("step")
               and e.step.phase == events_pb2.STEP_PHASE_DELTA)  # whole lines
    assert events[-1].result.output == "0\n1\n2\n[stderr]\noops"


async def test_an_exception_fails_the_call_and_the_session_lives_on(stub) -> None:
    session_id = await create(stub)
    await python(stub, session_id, "x = 41")
    failed = await python(stub, session_id, "x += 1\n1 / 0")
    assert failed.outcome == events_pb2.OUTCOME_FAILED
    assert (failed.error.code, failed.error.message) == (
        "PYTHON_EXCEPTION", "ZeroDivisionError: division by zero")
    assert "Traceback" in failed.output
    after = await python(stub, session_id, "x")
    assert as_dict(after)["structured_output"] == 42


async def test_a_shell_session_keeps_its_files_and_ends_its_background_jobs(stub) -> None:
    session_id = await create(stub, "shell")
    events = await run_tool(stub, "shell", {"command": "echo hello > kept.txt; sleep 600 &"},
                            session_id=session_id)
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result
    events = await run_tool(stub, "shell", {"command": "cat kept.txt; pgrep -c sleep || true"},
                            session_id=session_id)
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert result.output.splitlines()[:2] == ["hello", "0"]
    assert as_dict(result)["structured_output"]["exit_status"] == 0
    failed = (await run_tool(stub, "shell", {"command": "exit 3"},
                             session_id=session_id))[-1].result
    assert (failed.outcome, failed.error.code) == (events_pb2.OUTCOME_FAILED, "EXIT_STATUS")


async def test_the_session_kind_must_match_the_tool(stub) -> None:
    session_id = await create(stub, "shell")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await python(stub, session_id, "1")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(caught.value) == "SESSION_KIND_MISMATCH"


async def test_create_refuses_bad_kinds_and_limits_above_the_servers(stub) -> None:
    bad = [dict(kind=""), dict(kind="ruby"), dict(kind="x" * 10_000),
           dict(kind="python", ttl_seconds=10 ** 9), dict(kind="python", memory_mb=257),
           dict(kind="python", cpu_seconds=21), dict(kind="python", disk_mb=17),
           dict(kind="python", idle_seconds=10 ** 6)]
    for fields in bad:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.CreateSession(tool_service_pb2.CreateSessionRequest(**fields))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        [violations] = [d for d in status_details(caught.value) if hasattr(d, "field_violations")]
        assert violations.field_violations
    listed = await stub.ListSessions(tool_service_pb2.ListSessionsRequest())
    assert list(listed.sessions) == []
    # Asking for less than the server's is granted as asked.
    reply = await stub.CreateSession(tool_service_pb2.CreateSessionRequest(
        kind="python", memory_mb=128, cpu_seconds=5, disk_mb=4, ttl_seconds=60,
        idle_seconds=30))
    session = reply.session
    assert (session.memory_mb, session.cpu_seconds, session.disk_mb, session.idle_seconds) == (
        128, 5, 4, 30)
    assert session.expires_at.seconds - session.created_at.seconds in (59, 60, 61)


async def test_malformed_requests_are_invalid_argument_and_the_server_serves_on(auth) -> None:
    async with key_channel(auth.target, auth.key) as channel:
        for method in ("CreateSession", "CloseSession", "ListSessions"):
            call = channel.unary_unary(f"/stargrpc.v1.ToolService/{method}")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(b"\xff\xff\xff")
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        session_id = await create(stub)
        assert (await python(stub, session_id, "6 * 7")).structured_output.number_value == 42


async def test_unknown_closed_and_oversized_ids_are_not_found(stub) -> None:
    session_id = await create(stub)
    await stub.CloseSession(tool_service_pb2.CloseSessionRequest(session_id=session_id))
    for wrong in (session_id, "", "ses_" + "0" * 32, "x" * 100_000, "../../etc"):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await python(stub, session_id=wrong or "nope", code="1")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, wrong[:20]
        assert reason(caught.value) == "SESSION_NOT_FOUND"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.CloseSession(tool_service_pb2.CloseSessionRequest(session_id=wrong))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_session_is_its_owners_alone(auth, stub) -> None:
    session_id = await create(stub)
    await python(stub, session_id, "secret = 'mine'")
    other_key = auth.add_key("other", "admin", "privileged")
    async with key_channel(auth.target, other_key) as channel:
        other = tool_service_pb2_grpc.ToolServiceStub(channel)
        for attempt in (lambda: python(other, session_id, "secret"),
                        lambda: other.CloseSession(tool_service_pb2.CloseSessionRequest(
                            session_id=session_id))):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await attempt()
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert reason(caught.value) == "SESSION_NOT_FOUND"
        assert list((await other.ListSessions(tool_service_pb2.ListSessionsRequest())).sessions
                    ) == []
    assert as_dict(await python(stub, session_id, "secret"))["structured_output"] == "mine"


async def test_sessions_are_capped_per_principal_and_in_total(auth, stub) -> None:
    for _ in range(3):
        await create(stub)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await create(stub)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason(caught.value) == "SESSION_LIMIT"
    other_key = auth.add_key("other", "admin", "privileged")
    async with key_channel(auth.target, other_key) as channel:
        other = tool_service_pb2_grpc.ToolServiceStub(channel)
        await create(other)
        await create(other)
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # 5 on the server
            await create(other)
        assert reason(caught.value) == "SESSION_LIMIT"
    # A flood of creates at once gets no more than the cap either.
    listed = await stub.ListSessions(tool_service_pb2.ListSessionsRequest())
    await asyncio.gather(*(stub.CloseSession(tool_service_pb2.CloseSessionRequest(
        session_id=s.session_id)) for s in listed.sessions))
    results = await asyncio.gather(*(create(stub) for _ in range(10)), return_exceptions=True)
    made = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(made) == 3 and len(refused) == 7
    assert {reason(r) for r in refused} == {"SESSION_LIMIT"}


async def test_list_shows_running_totals(stub) -> None:
    session_id = await create(stub)
    await python(stub, session_id, "sum(i * i for i in range(2_000_000))")
    await python(stub, session_id, "open('blob', 'wb').write(b'x' * 100_000)")
    [listed] = (await stub.ListSessions(tool_service_pb2.ListSessionsRequest())).sessions
    assert listed.session_id == session_id and listed.kind == "python"
    assert listed.calls == 2 and not listed.busy
    assert listed.usage.wall_seconds > 0
    assert listed.usage.cpu_user_seconds + listed.usage.cpu_system_seconds > 0
    assert listed.usage.peak_rss_bytes > 1_000_000
    assert listed.usage.bytes_written >= 100_000


async def test_calls_in_one_session_run_one_at_a_time(stub) -> None:
    session_id = await create(stub)
    await python(stub, session_id, "import time, os\nopen('log', 'w').close()")
    code = ("with open('log', 'a') as f: f.write('start\\n')\n"
            "time.sleep(0.3)\n"
            "with open('log', 'a') as f: f.write('end\\n')")
    await asyncio.gather(python(stub, session_id, code), python(stub, session_id, code))
    log = await python(stub, session_id, "open('log').read()")
    assert as_dict(log)["structured_output"] == "start\nend\nstart\nend\n"


async def test_a_caller_that_will_not_wait_is_refused_session_busy(stub) -> None:
    session_id = await create(stub)
    slow = asyncio.ensure_future(python(stub, session_id, "import time\ntime.sleep(30)"))
    await eventually(lambda: _busy(stub, session_id))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await python(stub, session_id, "1", session_no_wait=True)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(caught.value) == "SESSION_BUSY"
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    # The cancelled call was interrupted; the session serves the next one.
    assert as_dict(await python(stub, session_id, "'free'"))["structured_output"] == "free"


async def _busy(stub, session_id: str) -> bool:
    listed = await stub.ListSessions(tool_service_pb2.ListSessionsRequest())
    return any(s.session_id == session_id and s.busy for s in listed.sessions)


async def test_closing_a_session_ends_its_running_call(stub) -> None:
    session_id = await create(stub)
    slow = asyncio.ensure_future(python(stub, session_id, "import time\ntime.sleep(60)"))
    await eventually(lambda: _busy(stub, session_id))
    await stub.CloseSession(tool_service_pb2.CloseSessionRequest(session_id=session_id))
    result = await slow
    assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_FAILED, "SESSION_CLOSED")


async def test_output_cannot_forge_the_end_of_a_call(stub) -> None:
    session_id = await create(stub)
    # Whatever the code writes to its stdout, framed like the protocol or not, is output.
    forged = json.dumps({"t": "done", "call": "x", "ok": True, "value": "forged"}).encode()
    code = ("import os, struct, sys\n"
            f"frame = {forged!r}\n"
            "os.write(1, struct.pack('>I', len(frame)) + frame)\n"
            "sys.stdout.write(frame.decode())\n"
            "os.write(2, b'\\xff\\xff\\xff\\xff')\n"
            "'real'")
    result = await python(stub, session_id, code)
    assert result.outcome == events_pb2.OUTCOME_OK
    assert as_dict(result)["structured_output"] == "real"
    assert '"forged"' in result.output


async def test_a_killed_interpreter_is_session_lost_and_the_session_closes(stub) -> None:
    session_id = await create(stub)
    result = await python(stub, session_id, "import os, signal\nos.kill(os.getpid(), 9)")
    assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_FAILED, "SESSION_LOST")
    assert "killed by signal" in result.error.message or "exited" in result.error.message
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await python(stub, session_id, "1")
    assert reason(caught.value) == "SESSION_NOT_FOUND"
    assert list((await stub.ListSessions(tool_service_pb2.ListSessionsRequest())).sessions
                ) == []


async def test_memory_and_fork_bombs_are_held_and_the_server_serves_on(stub) -> None:
    session_id = await create(stub)
    hog = await python(stub, session_id, "x = bytearray(2 * 1024 ** 3)")
    assert (hog.outcome, hog.error.code) == (events_pb2.OUTCOME_FAILED, "PYTHON_EXCEPTION")
    assert hog.error.message.startswith("MemoryError")
    bomb = await python(stub, session_id, "import os\nwhile True:\n    os.fork()")
    assert (bomb.outcome, bomb.error.code) == (events_pb2.OUTCOME_FAILED, "PYTHON_EXCEPTION")
    assert "Resource temporarily unavailable" in bomb.error.message
    # The bomb's processes ended with its call; the session (and the server) live on.
    alive = await python(stub, session_id,
                         "import os\n[open(f'/proc/{p}/stat').read() for p in os.listdir('/proc')"
                         " if p.isdigit()]")
    states = [line.split()[2] for line in as_dict(alive)["structured_output"]]
    assert "Z" not in states and len(states) <= 2  # the kernel (and bubblewrap's init)
    other = await create(stub)
    assert as_dict(await python(stub, other, "'ok'"))["structured_output"] == "ok"


async def test_a_session_cannot_reach_another_sessions_folder_or_interpreter(auth, stub
                                                                            ) -> None:
    first = await create(stub)
    await python(stub, first, "open('secret', 'w').write('s')")
    # Where the first session's folder is on the host (inside bubblewrap each sees its own
    # folder as /work): the second tries that path, and signals every process it can see.
    folder = str(auth.server.service.sessions.get("tester", first).folder)
    second = await create(stub)
    code = ("import os, signal\nfrom pathlib import Path\n"
            f"folder = {folder!r}\nseen = {{}}\n"
            "for name in ('read', 'list', 'write'):\n"
            "    try:\n"
            "        if name == 'read': Path(folder, 'secret').read_text()\n"
            "        elif name == 'list': os.listdir(folder)\n"
            "        else: Path(folder, 'planted').write_text('x')\n"
            "        seen[name] = 'allowed'\n"
            "    except OSError as exc:\n"
            "        seen[name] = type(exc).__name__\n"
            "for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    if pid != os.getpid():\n"
            "        try:\n"
            "            os.kill(pid, signal.SIGKILL)\n"
            "        except OSError:\n"
            "            pass\n"
            "seen")
    attempt = await python(stub, second, code)
    seen = as_dict(attempt)["structured_output"]
    assert set(seen) == {"read", "list", "write"}
    assert set(seen.values()) <= {"PermissionError", "FileNotFoundError"}, seen
    survived = await python(stub, first, "import os\nsorted(os.listdir('.'))")
    assert "planted" not in as_dict(survived)["structured_output"]
    assert as_dict(await python(stub, first, "open('secret').read()"))[
        "structured_output"] == "s"


async def test_start_run_runs_in_the_session_and_watch_run_follows_it(stub) -> None:
    session_id = await create(stub)
    await python(stub, session_id, "base = 40")
    started = await stub.StartRun(tool_service_pb2.StartRunRequest(
        tool_name="python", arguments_json=json.dumps({"code": "base + 2"}),
        session_id=session_id))
    events = [r.event async for r in stub.WatchRun(tool_service_pb2.WatchRunRequest(
        run_id=started.run_id))]
    assert as_dict(events[-1].result)["structured_output"] == 42
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.StartRun(tool_service_pb2.StartRunRequest(
            tool_name="python", arguments_json='{"code": "1"}', session_id="ses_nope"))
    assert reason(caught.value) == "SESSION_NOT_FOUND"


async def test_a_flood_of_closes_closes_once_and_the_server_serves_on(stub) -> None:
    session_id = await create(stub)
    closes = await asyncio.gather(*(stub.CloseSession(tool_service_pb2.CloseSessionRequest(
        session_id=session_id)) for _ in range(10)), return_exceptions=True)
    done = [c for c in closes if isinstance(c, tool_service_pb2.CloseSessionResponse)]
    refused = [c for c in closes if isinstance(c, grpc.aio.AioRpcError)]
    assert len(done) == 1 and len(refused) == 9
    assert {reason(r) for r in refused} == {"SESSION_NOT_FOUND"}
    lists = await asyncio.gather(*(stub.ListSessions(tool_service_pb2.ListSessionsRequest(
        with_files=True)) for _ in range(20)))
    assert all(list(listed.sessions) == [] for listed in lists)
    fresh = await create(stub)
    assert as_dict(await python(stub, fresh, "'ok'"))["structured_output"] == "ok"


async def test_a_file_whose_name_is_not_utf8_is_listed_escaped_and_not_sent(stub) -> None:
    # Its name cannot be text as it is: the session's listing shows its bytes escaped (the
    # listing had failed as UNKNOWN for as long as the file was there), and out/ tells it
    # skipped rather than failing the call's end.
    session_id = await create(stub)
    code = ("import os\nopen(b'bad\\xff.txt', 'wb').write(b'x')\n"
            "open(os.environ['OUTPUT_DIR'].encode() + b'/out\\xfe.txt', 'wb').write(b'y')\n"
            "open(os.path.join(os.environ['OUTPUT_DIR'], 'good.txt'), 'w').write('z')")
    result = await python(stub, session_id, code)
    listed = await stub.ListSessions(tool_service_pb2.ListSessionsRequest(with_files=True))

    assert result.outcome == events_pb2.OUTCOME_OK, result
    assert [f.name for f in result.writeback.sent_files] == ["good.txt"]
    [session] = listed.sessions
    assert ("bad\\xff.txt", 1) in [(f.name, f.size) for f in session.files]


async def test_files_left_in_the_output_folder_come_back_once(stub) -> None:
    session_id = await create(stub)
    code = ("import os\nout = os.environ['OUTPUT_DIR']\n"
            "open(os.path.join(out, 'report.txt'), 'w').write('done')\n"
            "os.symlink('/etc/hostname', os.path.join(out, 'sneaky'))\n"
            "open('kept.txt', 'w').write('stays')")
    result = await python(stub, session_id, code)
    [sent] = result.writeback.sent_files
    assert (sent.name, sent.content, sent.mime_type) == ("report.txt", b"done", "text/plain")
    events = await run_tool(stub, "python", {"code": "import os\nsorted(os.listdir(out))"},
                            session_id=session_id)
    assert list(events[-1].result.writeback.sent_files) == []
    assert as_dict(events[-1].result)["structured_output"] == ["sneaky"]  # left in place
    notices = [e.notice for e in events if e.HasField("notice")]
    assert [n.code for n in notices] == ["SESSION_FILES_SKIPPED"]
    assert "sneaky: not a plain file" in notices[0].message
    kept = await python(stub, session_id, "open('kept.txt').read()")
    assert as_dict(kept)["structured_output"] == "stays"


async def test_a_call_cancelled_as_soon_as_it_is_sent_leaves_its_session_serving(stub) -> None:
    # The interrupt can reach the kernel right behind the call's frame, before the kernel
    # has taken the call up: the call must then never run, and the session live on (an
    # interrupt dropped for a call "not yet current" let it run on, past the grace, and the
    # session was closed as one whose interpreter will not stop).
    session_id = await create(stub)
    for round_ in range(5):
        started = await stub.StartRun(tool_service_pb2.StartRunRequest(
            tool_name="python", session_id=session_id,
            arguments_json=json.dumps({"code": f"import time\nround_ = {round_}\n"
                                               "time.sleep(30)"})))
        await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=started.run_id))
        events = [r.event async for r in stub.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=started.run_id))]
        assert events[-1].result.outcome == events_pb2.OUTCOME_CANCELLED, events[-1].result
        result = await python(stub, session_id, "'free'")
        assert as_dict(result).get("structured_output") == "free", result


async def _cancelled_once_up(stub, session_id: str, code: str) -> list[events_pb2.RunEvent]:
    """Runs ``code`` in the session, cancels it once it has printed 'up', and returns all
    its events."""
    call = stub.Execute(tool_service_pb2.ExecuteRequest(
        tool_name="python", session_id=session_id, arguments_json=json.dumps({"code": code})))
    run_id = ""
    async for response in call:
        run_id = response.event.run_id
        if response.event.HasField("step") and "up" in response.event.step.delta:
            break
    await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=run_id))
    return [response.event async for response in call]


async def test_a_handler_of_the_codes_own_is_signalled_once_per_interrupt(stub) -> None:
    # The kernel signals again only its own handler (which stops the call): a SIGINT
    # handler the code installed is called once, and the call goes on as it decides.
    session_id = await create(stub)
    # It runs until its handler is called (bounded), then 0.5 s on: where repeated
    # signals would land (one every 50 ms).
    code = ("import signal, time\ncalls = 0\ndef mine(signum, frame):\n"
            "    global calls\n    calls += 1\nsignal.signal(signal.SIGINT, mine)\n"
            "print('up', flush=True)\nuntil = time.monotonic() + 20\n"
            "while time.monotonic() < until and not calls:\n    time.sleep(0.01)\n"
            "time.sleep(0.5)\n")
    events = await _cancelled_once_up(stub, session_id, code)
    assert events[-1].result.outcome == events_pb2.OUTCOME_CANCELLED, events[-1].result

    result = await python(stub, session_id, "calls")
    assert as_dict(result).get("structured_output") == 1, result


async def test_a_call_that_handles_its_interrupt_gets_one_and_finishes_its_cleanup(
        stub) -> None:
    # The kernel signals an interrupt again until the call takes it (a signal landing just
    # before the call blocks interrupts nothing): once taken, no more. A call that catches
    # it and cleans up for a while is not interrupted again in its cleanup.
    session_id = await create(stub)
    code = ("import time\ntry:\n    print('up', flush=True)\n    time.sleep(30)\n"
            "except KeyboardInterrupt:\n    time.sleep(0.3)\n"
            "    open('cleaned', 'w').write('yes')\n")
    for _ in range(3):
        events = await _cancelled_once_up(stub, session_id, code)
        assert events[-1].result.outcome == events_pb2.OUTCOME_CANCELLED, events[-1].result
        # Its cleanup ran to the end before the session's next call.
        result = await python(stub, session_id,
                              "import os\nopen('cleaned').read() if os.path.exists('cleaned') "
                              "else 'no'")
        assert as_dict(result).get("structured_output") == "yes", result
        await python(stub, session_id, "import os\nos.remove('cleaned')")


async def test_lone_surrogates_in_a_value_come_back_escaped_never_merged(stub) -> None:
    # A str holding a lone surrogate (a file name read with surrogateescape, say) has no
    # UTF-8 form: it comes back with the escape spelt out, and two keys that differ only
    # there stay two keys.
    session_id = await create(stub)
    ran = await python(stub, session_id, "{'\\udcff': 1, '\\udcfe': 2, '?': 3, 'v': 'a\\ud800'}")
    assert ran.outcome == events_pb2.OUTCOME_OK, ran
    assert as_dict(ran)["structured_output"] == {"\\udcff": 1, "\\udcfe": 2, "?": 3,
                                                 "v": "a\\ud800"}
    printed = await python(stub, session_id, "print('b\\udcff')")
    assert printed.output == "b\\udcff"
