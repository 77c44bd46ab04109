"""Custom critics: chosen by setting and flag, by entry point, per tool; their verdicts as
notices, metrics and audit facts; broken critics; and supervision on every entry point
(the test harness, the HTTP gateway, an embedder's own interceptor chain)."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from stargrpc.cli.serve import serve as serve_command
from stargrpc.cli.serve import settings_from_flags
from stargrpc.errors import CriticConfigError
from stargrpc.registry import Registry, spec_of
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.settings import Settings
from stargrpc.testing import run_tool as run_in_harness
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.critic.custom import MALFORMED, judged_by_an_exit
from tests.critic.helpers import execute, notices, registry, verdicts
from tests.critic.tools import hangs
from tests.helpers import phases

WAIT = 30.0  # generous bound on waits for a run to end; never a performance claim


async def test_a_critic_chosen_by_setting_judges_every_run(make_server) -> None:
    stops, warns, steers = (verdicts(v, "words") for v in ("stop", "warn", "steer"))
    server = await make_server(registry=registry(), critic="tests.critic.custom:make")

    events = await execute(server, "says", {"words": ["careful", "lost", "forbidden",
                                                      "never said"]})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_CANCELLED
    assert result.error.code == "FORBIDDEN_WORD"
    assert result.error.message == "it said the forbidden word"
    assert "never said" not in result.output
    shown = notices(events)
    assert ("CRITIC_WARNING", "it is being careful") in shown
    assert ("CRITIC_STEERED", "the words critic steered the run") in shown
    assert ("STEERED", "turn left") in shown
    assert ("CRITIC_STOPPED", "the words critic stopped the run: it said the forbidden word"
            ) in shown
    assert verdicts("stop", "words") == stops + 1
    assert verdicts("warn", "words") == warns + 1
    assert verdicts("steer", "words") == steers + 1


async def test_a_critic_extension_is_a_notice_and_never_passes_the_hard_cap(make_server
                                                                           ) -> None:
    server = await make_server(registry=registry(), critic="tests.critic.custom:make",
                               critic_soft_timeout=0.3, critic_hard_timeout=1.0)

    events = await execute(server, "says", {"words": ["more", "wait"]})

    assert ("CRITIC_EXTENDED", "the words critic gave the run 30 s more: it asked for more "
            "(the run still ends within 1 s)") in [
        (code, message.replace("0.99 s", "1 s")) for code, message in notices(events)]
    result = events[-1].result
    assert result.error.code == "CRITIC_HARD_TIMEOUT"  # 30 s asked, the 1 s cap held
    assert result.duration.ToNanoseconds() < 5e9


async def test_a_critic_that_never_extends_lets_the_soft_deadline_stop_the_run(make_server
                                                                               ) -> None:
    server = await make_server(registry=registry(), critic="tests.critic.custom:make",
                               critic_soft_timeout=0.4)

    # Deltas every 0.1 s would be progress for the rules: this critic does not care.
    events = await execute(server, "says", {"words": ["a"] * 30, "pause": 0.1})

    assert events[-1].result.error.code == "CRITIC_NO_PROGRESS"


async def test_the_flag_and_the_environment_name_the_critic(monkeypatch) -> None:
    flagged = settings_from_flags(None, (), {"critic": "tests.critic.custom:make"})
    assert flagged.critic == "tests.critic.custom:make"
    monkeypatch.setenv("STARGRPC_CRITIC", "tests.critic.custom:make")
    monkeypatch.setenv("STARGRPC_CRITIC_URL", "127.0.0.1:1")
    with pytest.raises(ValidationError, match="critic or critic_url, not both"):
        Settings()
    names = {option.name for option in serve_command.params}
    assert {"critic", "critic_url"} <= names


def install_entry_point(folder: Path, name: str, value: str) -> None:
    """A minimal installed distribution declaring one stargrpc.critics entry point."""
    info = folder / "stargrpc_test_critics-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stargrpc-test-critics\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(f"""\
        [stargrpc.critics]
        {name} = {value}
        """))


async def test_a_critic_chosen_by_entry_point(make_server, tmp_path: Path, monkeypatch
                                              ) -> None:
    install_entry_point(tmp_path, "words", "tests.critic.custom:WordCritic")
    monkeypatch.syspath_prepend(str(tmp_path))
    server = await make_server(registry=registry(), critic="words")

    events = await execute(server, "says", {"words": ["forbidden", "wait"]})

    assert events[-1].result.error.code == "FORBIDDEN_WORD"


async def test_a_tool_names_its_own_critic(make_server) -> None:
    server = await make_server(registry=registry())  # the server's critic: the rules

    events = await execute(server, "judged_by_words", {})
    plain = await execute(server, "says", {"words": ["forbidden"]})

    assert events[-1].result.error.code == "FORBIDDEN_WORD"
    assert plain[-1].result.outcome == events_pb2.OUTCOME_OK  # the rules do not mind words


@pytest.mark.parametrize(("critic", "error"), [
    ("tests.critic.nowhere:make", "cannot import 'tests.critic.nowhere'"),
    ("tests.critic.custom:missing", "has no 'missing'"),
    ("tests.critic.custom:NotACritic", "NotACritic is not a critic"),
    ("no-such-entry-point", "none is called that"),
])
async def test_a_critic_that_cannot_be_loaded_stops_start_up(critic: str, error: str) -> None:
    with pytest.raises(CriticConfigError, match=error):
        StargrpcServer(Settings(port=0, insecure_no_auth=True, critic=critic),
                       registry=registry())


async def test_a_crashing_critic_falls_back_to_the_rules(make_server) -> None:
    fallbacks = verdicts("fallback", "crashing")
    server = await make_server(registry=registry())

    events = await execute(server, "judged_by_a_crash", {})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert events[-1].result.output == "survived"
    assert ("CRITIC_FALLBACK", "the crashing critic failed (RuntimeError); the rules "
            "supervise the run from here") in notices(events)
    assert verdicts("fallback", "crashing") == fallbacks + 1


@pytest.mark.parametrize("word", sorted(MALFORMED))
async def test_a_malformed_verdict_hands_the_run_to_the_rules(make_server, word: str) -> None:
    # A verdict of the right class with a field of the wrong type (a None message, a time
    # in a string) ended the run INTERNAL instead of dropping the critic.
    server = await make_server(registry=registry(), critic="tests.critic.custom:malformed")

    events = await execute(server, "says", {"words": [word, "after"]})

    result = events[-1].result
    assert (result.outcome, result.output) == (events_pb2.OUTCOME_OK, "said")
    [fallback] = [message for code, message in notices(events) if code == "CRITIC_FALLBACK"]
    assert fallback.startswith("the malformed critic answered garbage (")
    assert fallback.endswith("; the rules supervise the run from here")


@pytest.mark.parametrize("where", ["judge", "observe", "close"])
async def test_a_critic_that_exits_fails_no_run_and_stops_no_server(make_server,
                                                                    where: str) -> None:
    # SystemExit or KeyboardInterrupt out of a critic went through the run's ending (or a
    # callback of the event loop) and stopped the loop: the whole server ended.
    spec = spec_of(judged_by_an_exit(where))
    assert spec is not None
    server = await make_server(registry=Registry([spec, *registry().values()]))

    events = await execute(server, spec.name, {})

    assert (events[-1].result.outcome, events[-1].result.output) == (
        events_pb2.OUTCOME_OK, "survived")
    again = await execute(server, "says", {"words": ["still", "serving"]})
    assert again[-1].result.output == "said"


async def test_a_run_of_the_test_harness_is_supervised() -> None:
    recorded = await asyncio.wait_for(
        run_in_harness(hangs, settings=Settings(critic_soft_timeout=0.4)), WAIT)

    assert recorded.result.error.code == "CRITIC_NO_PROGRESS"
    assert phases(recorded.events)[-3:] == ["NOTICE", "END s0 ERROR", "RESULT TIMEOUT"]


async def test_a_run_of_the_http_gateway_is_supervised(make_server) -> None:
    import httpx

    server = await make_server(registry=registry(), http_port=0, critic_soft_timeout=0.4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http.gateway_port}",
                                 timeout=WAIT) as http:
        reply = await http.post("/v1/tools/hangs:execute?wait=true", json={"arguments": {}})

    assert reply.status_code == 200, reply.text
    assert reply.json()["result"]["error"]["code"] == "CRITIC_NO_PROGRESS"


async def test_an_embedder_without_interceptors_still_gets_supervision(make_server) -> None:
    server = await make_server(registry=registry(), interceptors=[], critic_soft_timeout=0.4)

    events = await execute(server, "hangs", {})

    assert events[-1].result.error.code == "CRITIC_NO_PROGRESS"
    assert all(event.HasField("critic_time_left") for event in events)


async def test_without_the_critic_interceptor_the_callers_deadline_still_wins(make_server
                                                                             ) -> None:
    server = await make_server(registry=registry(), interceptors=[])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        request = tool_service_pb2.ExecuteRequest(tool_name="hangs", idempotency_key="dl")
        first = await anext(aiter(stub.Execute(request, timeout=0.5)))
        watched = [response.event async for response in stub.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=first.event.run_id), timeout=WAIT)]

    assert watched[-1].result.error.code == "CLIENT_DEADLINE"
