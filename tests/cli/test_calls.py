"""``stargrpc tools/call/watch/cancel`` as a user runs them: a child process against a real
server, through the Python SDK."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from google.protobuf import json_format

from stargrpc.client import AsyncClient
from stargrpc.errors import FieldViolation, InvalidArgument, Unavailable
from stargrpc.server.grpc_server import StargrpcServer
from tests.client.faults import Recorder

TIMEOUT = 60


async def _stargrpc(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_call_json_sends_the_api_key_and_retries_a_refusal(
        recorded_server: StargrpcServer, recorder: Recorder) -> None:
    recorder.fail("Execute", Unavailable("draining"))
    target = f"127.0.0.1:{recorded_server.port}"

    code, out, _ = await _stargrpc("call", "--target", target, "count", "--args", '{"to": 2}',
                                   "--json", env={"STARGRPC_API_KEY": "from-env"})

    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [int(line["seq"]) for line in lines] == list(range(1, len(lines) + 1))
    assert lines[-1]["result"]["outcome"] == "OUTCOME_OK"
    attempts = recorder.seen("Execute")
    assert len(attempts) == 2
    assert attempts[0].request.idempotency_key == attempts[1].request.idempotency_key != ""
    assert {a.metadata["authorization"] for a in attempts} == {"Bearer from-env"}


async def test_tools_json_and_refusals_with_their_details(
        recorded_server: StargrpcServer, recorder: Recorder) -> None:
    target = f"127.0.0.1:{recorded_server.port}"

    (code, out, _), (bad_code, _, err) = await asyncio.gather(
        _stargrpc("tools", "--target", target, "--json", "--api-key", "k"),
        _stargrpc("call", "--target", target, "count", "--args", '{"to": "many"}'))

    assert code == 0
    catalog = json.loads(out)
    assert catalog["catalog_hash"] == recorded_server.runtime.registry.catalog_hash
    assert {"count", "echo", "sleep"} <= {t["name"] for t in catalog["tools"]}
    assert recorder.seen("ListTools")[0].metadata["authorization"] == "Bearer k"
    assert bad_code == 1
    assert "INVALID_ARGUMENT" in err
    assert "arguments.to:" in err


async def test_watch_and_cancel_a_run(recorded_server: StargrpcServer) -> None:
    target = f"127.0.0.1:{recorded_server.port}"
    async with AsyncClient.connect(target) as client:
        stream = client.execute("sleep", {"seconds": 30, "heartbeat_every": 0.05})
        run_id = (await anext(stream)).run_id
        watcher = asyncio.create_task(
            _stargrpc("watch", "--target", target, run_id, "--after-seq", "1", "--json"))

        code, _, err = await _stargrpc("cancel", "--target", target, run_id, "--reason",
                                       "from the shell")
        assert (code, err.strip()) == (0, "cancelled")
        code, out, _ = await watcher
        rest = [event async for event in stream]

    assert code == 7  # the outcome was CANCELLED
    lines = [json.loads(line) for line in out.splitlines()]
    assert int(lines[0]["seq"]) == 2
    assert lines[-1]["result"]["outcome"] == "OUTCOME_CANCELLED"
    assert "from the shell" in lines[-1]["result"]["error"]["message"]
    assert int(lines[-1]["seq"]) == rest[-1].seq


async def test_watch_at_or_past_the_end_of_a_finished_run_exits_zero(
        recorded_server: StargrpcServer) -> None:
    target = f"127.0.0.1:{recorded_server.port}"
    async with AsyncClient.connect(target) as client:
        events = [event async for event in client.execute("count", {"to": 2})]
        past = [event async for event in client.watch(events[0].run_id, len(events) + 3)]
    run_id, last = events[0].run_id, len(events)

    (code, out, err), (tail_code, tail, _) = await asyncio.gather(
        _stargrpc("watch", "--target", target, run_id, "--after-seq", str(last)),
        _stargrpc("watch", "--target", target, run_id, "--after-seq", str(last - 1), "--json"))

    assert past == []  # the SDK takes RUN_FINISHED for the end, not for a break
    assert (code, out) == (0, "")
    assert f"run {run_id} has ended: nothing follows seq {last}" in err
    assert "could not be resumed" not in err
    assert tail_code == 0
    assert [int(json.loads(line)["seq"]) for line in tail.splitlines()] == [last]


async def test_call_prints_streamed_output_once_and_the_rest_after_the_outcome(
        recorded_server: StargrpcServer) -> None:
    target = f"127.0.0.1:{recorded_server.port}"

    (echo_code, echoed, _), (count_code, counted, _) = await asyncio.gather(
        _stargrpc("call", "--target", target, "echo", "--args", '{"text": "hello there"}'),
        _stargrpc("call", "--target", target, "count", "--args", '{"to": 2}'))

    assert echo_code == count_code == 0
    assert echoed.count("hello there") == 1
    assert echoed.splitlines()[-1] == "= OK"
    # count streams the numbers and returns other text: that text is shown after "= OK".
    assert counted.splitlines()[-2:] == ["= OK", "counted to 2"]
    assert counted.count("counted to 2") == 1


async def test_call_sends_lane_priority_and_max_wait(recorded_server: StargrpcServer,
                                                    recorder: Recorder) -> None:
    target = f"127.0.0.1:{recorded_server.port}"

    (code, _, _), (bad_code, _, err) = await asyncio.gather(
        _stargrpc("call", "--target", target, "count", "--args", '{"to": 1}', "--json",
                  "--priority", "3", "--max-wait", "2.5"),
        _stargrpc("call", "--target", target, "count", "--args", '{"to": 1}',
                  "--lane", "no-such-lane"))

    assert code == 0
    sent = {(a.request.priority, a.request.max_wait_seconds, a.request.lane)
            for a in recorder.seen("Execute")}
    assert sent == {(3, 2.5, ""), (0, 0.0, "no-such-lane")}
    assert bad_code == 1
    assert "LANE_UNKNOWN" in err and "lane:" in err


async def test_call_takes_the_arguments_after_the_tools_name_or_from_standard_input(
        recorded_server: StargrpcServer, recorder: Recorder) -> None:
    # What a newcomer types first: the JSON right after the tool, as with grpcurl's -d.
    target = f"127.0.0.1:{recorded_server.port}"
    positional = await _stargrpc("call", "--target", target, "echo", '{"text": "hi there"}',
                                 "--json")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", "call", "--target", target, "echo", "-", "--json",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    piped, _ = await asyncio.wait_for(proc.communicate(b'{"text": "from a pipe"}'), TIMEOUT)
    twice, not_object, not_json = await asyncio.gather(
        _stargrpc("call", "--target", target, "echo", '{"text": "a"}', "--args", '{"text": "b"}'),
        _stargrpc("call", "--target", target, "echo", '["text"]'),
        _stargrpc("call", "--target", target, "echo", "{text: hi}"))

    assert positional[0] == 0 and proc.returncode == 0
    assert [json.loads(out.splitlines()[-1])["result"]["outcome"]
            for out in (positional[1], piped.decode())] == ["OUTCOME_OK"] * 2
    sent = [json.loads(seen.request.arguments_json) if seen.request.arguments_json
            else json_format.MessageToDict(seen.request.arguments)
            for seen in recorder.seen("Execute")]
    assert {"text": "hi there"} in sent and {"text": "from a pipe"} in sent
    assert twice[0] == 2 and "give the arguments once" in twice[2]
    assert not_object[0] == 2 and "must be a JSON object" in not_object[2]
    assert "ARGUMENTS" in not_object[2]
    assert not_json[0] == 2 and "not valid JSON" in not_json[2]
    assert len(recorder.seen("Execute")) == 2  # the refused ones never reached the server


async def _stargrpc_bytes(*args: str | bytes) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_input_that_cannot_be_sent_is_a_one_line_error_not_a_traceback(
        recorded_server: StargrpcServer) -> None:
    # Each is refused before any call: exit 2 and a line saying what, never a traceback.
    target = f"127.0.0.1:{recorded_server.port}"
    cases: list[tuple[tuple[str | bytes, ...], str]] = [
        (("call", "--target", target, "echo", "[" * 3000 + "]" * 3000), "nested too deeply"),
        (("state", "set", "--target", target, "--scope", "global", "k",
          "[" * 3000 + "]" * 3000),
         "nested too deeply"),
        (("watch", "--target", target, "r", "--after-seq", str(2**70)), "--after-seq"),
        (("call", "--target", target, "echo", "{}", "--priority", str(10**12)), "--priority"),
        (("cancel", "--target", target, b"\x80"), "not UTF-8"),
        (("runs", "--target", target, "--api-key", "key\r"), "header cannot carry"),
        (("call", "--target", target, "echo", "{}", "--timeout", "nan"), "--timeout"),
        (("health", "--target", target, "--timeout", "-1"), "--timeout"),
    ]
    for args, said in cases:
        code, _, err = await _stargrpc_bytes(*args)
        assert (code, "Traceback" in err) == (2, False), (args, err)
        assert said in err, (args, err)


async def test_what_a_server_sends_is_shown_to_a_terminal_never_obeyed(
        recorded_server: StargrpcServer, recorder: Recorder) -> None:
    """An escape sequence in what comes back (here a refusal's message and field violation)
    is spelt out: a server cannot retitle the window or write the clipboard of whoever reads
    the CLI's output (OSC 0 and OSC 52 below)."""
    target = f"127.0.0.1:{recorded_server.port}"
    hostile = "\x1b]0;owned\x07\x1b]52;c;ZXZpbA==\x07\u202ex"
    recorder.fail("Execute", InvalidArgument(f"refused {hostile}",
                                             [FieldViolation("arguments", hostile)]))

    code, _, err = await _stargrpc("call", "--target", target, "echo", '{"text": "x"}')

    assert code == 1
    assert "\x1b" not in err and "\x07" not in err and "\u202e" not in err
    assert "\\x1b]0;owned\\x07" in err and "\\u202e" in err


def test_a_terminal_is_shown_escapes_a_pipe_is_given_the_output_as_it_came() -> None:
    import io

    from stargrpc.cli.client_commands import TextRenderer
    from stargrpc.v1 import events_pb2

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def rendered(out: io.StringIO) -> str:
        renderer = TextRenderer(out)
        start = events_pb2.RunEvent()
        start.step.phase = events_pb2.STEP_PHASE_START
        start.step.step.id, start.step.step.title = "s0", "title \x1b[2J"
        delta = events_pb2.RunEvent()
        delta.step.phase = events_pb2.STEP_PHASE_DELTA
        delta.step.step.id, delta.step.delta = "s0", "out \x1b]52;c;eA==\x07\n"
        result = events_pb2.RunEvent()
        result.result.outcome = events_pb2.OUTCOME_OK
        result.result.writeback.sent_files.add(name="a\x1b[8mb.txt", mime_type="text/plain")
        for event in (start, delta, result):
            renderer.render(event)
        renderer.close()
        return out.getvalue()

    shown, piped = rendered(Terminal()), rendered(io.StringIO())

    assert "\x1b" not in shown and "\x07" not in shown
    assert "title \\x1b[2J" in shown and "out \\x1b]52;c;eA==\\x07" in shown
    assert "file a\\x1b[8mb.txt" in shown
    assert "out \x1b]52;c;eA==\x07\n" in piped  # the run's output, as it came
    assert "title \\x1b[2J" in piped and "file a\\x1b[8mb.txt" in piped  # its metadata not
