"""The remote critic: a real CriticService on 127.0.0.1:0 judging runs of a real server —
extending, steering, stopping — and the rules taking over a run when the critic is killed
mid-run, answers too slowly, answers garbage or cannot be reached."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from examples.remote_critic import STEER_MESSAGE
from examples.remote_critic import serve as serve_example
from stargrpc.critic.supervision import MAX_VERDICT_NOTICES
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import critic_pb2, critic_pb2_grpc, events_pb2
from tests.critic.helpers import execute, notices, registry, verdicts

WAIT = 30.0  # generous bound on waits for a run to end; never a performance claim

Answer = Callable[[int], critic_pb2.SuperviseResponse | None]


def extend(seconds: float, reason: str = "") -> critic_pb2.SuperviseResponse:
    response = critic_pb2.SuperviseResponse(extend=critic_pb2.Extend(reason=reason))
    response.extend.within.FromNanoseconds(int(seconds * 1e9))
    return response


class Scripted(critic_pb2_grpc.CriticServiceServicer):
    """Answers the start with ``first`` (if any) and the n-th ask with ``on_ask(n)`` after
    ``ask_delay`` seconds; records what it was sent."""

    def __init__(self, *, first: critic_pb2.SuperviseResponse | None = None,
                 on_ask: Answer = lambda n: None, ask_delay: float = 0.0) -> None:
        self.first = first
        self.on_ask = on_ask
        self.ask_delay = ask_delay
        self.started = asyncio.Event()
        self.received: list[critic_pb2.SuperviseRequest] = []

    async def Supervise(self, request_iterator: AsyncIterator[critic_pb2.SuperviseRequest],
                        context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[critic_pb2.SuperviseResponse]:
        asks = 0
        async for request in request_iterator:
            self.received.append(request)
            kind = request.WhichOneof("kind")
            if kind == "start":
                self.started.set()
                if self.first is not None:
                    yield self.first
            elif kind == "ask":
                asks += 1
                await asyncio.sleep(self.ask_delay)
                answer = self.on_ask(asks)
                if answer is not None:
                    yield answer


@pytest.fixture
async def critic_server() -> AsyncIterator[Callable[[critic_pb2_grpc.CriticServiceServicer],
                                                    asyncio.Future[tuple[grpc.aio.Server, str]]]]:
    started: list[grpc.aio.Server] = []

    async def start(servicer: critic_pb2_grpc.CriticServiceServicer
                    ) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        critic_pb2_grpc.add_CriticServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        started.append(server)
        return server, f"127.0.0.1:{port}"

    yield start  # type: ignore[misc]
    for server in started:
        await server.stop(0)


async def audit_details(server: StargrpcServer) -> list[str]:
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await audit.writer.flush()
    return [record.detail async for record in audit.writer.store.scan()]


async def test_the_remote_critic_extends_but_never_past_the_hard_cap(make_server,
                                                                    critic_server) -> None:
    extensions = verdicts("extend", "remote")
    critic = Scripted(on_ask=lambda n: extend(0.3, f"still thinking ({n})"))
    _, target = await critic_server(critic)
    server = await make_server(registry=registry(), critic_url=target,
                               critic_soft_timeout=0.3, critic_hard_timeout=1.5)

    events = await execute(server, "hangs", {})

    result = events[-1].result
    assert result.error.code == "CRITIC_HARD_TIMEOUT"  # extended again and again, then capped
    extended = [message for code, message in notices(events) if code == "CRITIC_EXTENDED"]
    assert len(extended) >= 2
    assert extended[0] == "the remote critic gave the run 0.3 s more: still thinking (1)"
    assert verdicts("extend", "remote") >= extensions + 2
    # The critic saw the start (with the limits), the events and the asks.
    start = critic.received[0].start
    assert (start.tool_name, start.soft_timeout.ToMilliseconds()) == ("hangs", 300)
    assert start.hard_timeout.ToMilliseconds() == 1500
    assert critic.received[1].event.step.phase == events_pb2.STEP_PHASE_START
    assert any(request.HasField("ask") for request in critic.received)
    assert any("critic remote: extend" in detail for detail in await audit_details(server))


async def test_the_example_critic_stops_a_loop(make_server) -> None:
    critic, port = await serve_example(0, repeats=3)
    try:
        server = await make_server(registry=registry(), critic_url=f"127.0.0.1:{port}")
        events = await execute(server, "says", {"words": ["same\n"] * 10, "pause": 0.02})
    finally:
        await critic.stop(0)

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_CANCELLED
    assert result.error.code == "LOOP_DETECTED"
    assert result.error.message == "the same line came 3 times in a row: 'same'"
    assert result.output.count("same") < 10
    assert ("CRITIC_STOPPED", "the remote critic stopped the run: the same line came 3 times "
            "in a row: 'same'") in notices(events)


async def test_the_example_critic_steers_a_silent_run_then_lets_it_stop(make_server) -> None:
    critic, port = await serve_example(0)
    try:
        server = await make_server(registry=registry(), critic_url=f"127.0.0.1:{port}",
                                   critic_soft_timeout=0.6)
        events = await execute(server, "hangs", {})
    finally:
        await critic.stop(0)

    shown = notices(events)
    assert ("CRITIC_STEERED", "the remote critic steered the run") in shown
    assert ("STEERED", STEER_MESSAGE) in shown
    # It had said something before the first ask (extended), nothing before the second.
    assert [code for code, _ in shown].count("CRITIC_EXTENDED") == 1
    assert events[-1].result.error.code == "CRITIC_NO_PROGRESS"


async def test_a_critic_killed_mid_run_hands_the_run_to_the_rules(make_server,
                                                                  critic_server) -> None:
    fallbacks = verdicts("fallback", "remote")
    critic = Scripted()
    critic_grpc, target = await critic_server(critic)
    server = await make_server(registry=registry(), critic_url=target,
                               critic_soft_timeout=0.5)
    run = asyncio.create_task(execute(server, "says", {"words": ["w"] * 20, "pause": 0.05}))
    await asyncio.wait_for(critic.started.wait(), WAIT)
    await critic_grpc.stop(0)

    events = await asyncio.wait_for(run, WAIT)

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result.error  # healthy: it lived on
    [fallback] = [message for code, message in notices(events) if code == "CRITIC_FALLBACK"]
    assert fallback.startswith("the remote critic is unreachable or disconnected (")
    assert fallback.endswith("); the rules supervise the run from here")
    assert verdicts("fallback", "remote") == fallbacks + 1
    assert any("fell back to the rules: is unreachable" in detail
               for detail in await audit_details(server))


async def test_a_slow_critic_hands_the_run_to_the_rules(make_server, critic_server) -> None:
    critic = Scripted(on_ask=lambda n: extend(10), ask_delay=3.0)
    _, target = await critic_server(critic)
    server = await make_server(registry=registry(), critic_url=target,
                               critic_soft_timeout=0.3, critic_verdict_timeout_seconds=0.2)

    # Progress every 0.05 s for 1 s: the rules keep it alive once the critic is dropped.
    events = await execute(server, "says", {"words": ["w"] * 20, "pause": 0.05})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert ("CRITIC_FALLBACK", "the remote critic did not answer within 0.2 s; the rules "
            "supervise the run from here") in notices(events)


async def test_a_slow_critic_does_not_save_a_hung_run(make_server, critic_server) -> None:
    critic = Scripted(on_ask=lambda n: extend(10), ask_delay=3.0)
    _, target = await critic_server(critic)
    server = await make_server(registry=registry(), critic_url=target,
                               critic_soft_timeout=0.3, critic_verdict_timeout_seconds=0.2)

    events = await execute(server, "hangs", {})

    assert [code for code, _ in notices(events)].count("CRITIC_FALLBACK") == 1
    result = events[-1].result
    assert result.error.code == "CRITIC_NO_PROGRESS"
    assert result.duration.ToNanoseconds() < 2e9  # the budget, not the critic's 3 s


@pytest.mark.parametrize(("garbage", "said"), [
    (critic_pb2.SuperviseResponse(), "a response without a verdict"),
    (extend(-1), "an extension must be a positive time"),
    (critic_pb2.SuperviseResponse(stop=critic_pb2.Stop(code="not a code!")),
     "a stop code must look like LOOP_DETECTED"),
    (critic_pb2.SuperviseResponse(steer=critic_pb2.Steer(message=" ")),
     "a steer verdict needs a message"),
    (critic_pb2.SuperviseResponse(warn=critic_pb2.Warn(message="x" * 5000)),
     "over 4096 bytes"),
])
async def test_garbage_from_the_critic_hands_the_run_to_the_rules(
        make_server, critic_server, garbage: critic_pb2.SuperviseResponse, said: str) -> None:
    _, target = await critic_server(Scripted(first=garbage))
    server = await make_server(registry=registry(), critic_url=target)

    events = await execute(server, "says", {"words": ["a", "b"], "pause": 0.05})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    [fallback] = [message for code, message in notices(events) if code == "CRITIC_FALLBACK"]
    assert said in fallback
    assert fallback.startswith("the remote critic answered garbage (")


async def test_an_unreachable_critic_never_hurts_a_run(make_server) -> None:
    server = await make_server(registry=registry(), critic_url="127.0.0.1:1")

    first = await execute(server, "says", {"words": ["a", "b"], "pause": 0.2})
    second = await execute(server, "says", {"words": ["c"]})  # the server keeps serving

    assert [code for code, _ in notices(first)] == ["CRITIC_FALLBACK"]
    for events in (first, second):
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    # A run that ends before the connection fails is simply over: nothing to fall back.
    assert [code for code, _ in notices(second)] in ([], ["CRITIC_FALLBACK"])


class Flooding(critic_pb2_grpc.CriticServiceServicer):
    """Answers the start with ``warnings`` warnings as fast as the stream takes them, then
    stops the run; reads what it is sent until the stream ends."""

    def __init__(self, warnings: int) -> None:
        self.warnings = warnings

    async def Supervise(self, request_iterator: AsyncIterator[critic_pb2.SuperviseRequest],
                        context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[critic_pb2.SuperviseResponse]:
        async for request in request_iterator:
            if request.WhichOneof("kind") == "start":
                for n in range(self.warnings):
                    yield critic_pb2.SuperviseResponse(warn=critic_pb2.Warn(
                        message=f"warning {n}"))
                yield critic_pb2.SuperviseResponse(stop=critic_pb2.Stop(
                    code="FLOODED", reason="said all it had to say"))


async def test_a_critic_flooding_warnings_leaves_the_runs_log_bounded(make_server,
                                                                      critic_server) -> None:
    flood = 5_000
    warns = verdicts("warn", "remote")
    _, target = await critic_server(Flooding(flood))
    server = await make_server(registry=registry(), critic_url=target,
                               critic_soft_timeout=60)

    events = await execute(server, "hangs", {})

    result = events[-1].result  # the run still ends with its Result: the critic's stop
    assert result.outcome == events_pb2.OUTCOME_CANCELLED
    assert result.error.code == "FLOODED"
    codes = [code for code, _ in notices(events)]
    warnings = [e.notice for e in events if e.notice.code == "CRITIC_WARNING"]
    assert [n.message for n in warnings] == [
        f"warning {n}" for n in range(MAX_VERDICT_NOTICES)]
    # The server's notice, saying the rest is left out.
    [limited] = [e.notice for e in events if e.notice.code == "CRITIC_NOTICES_LIMITED"]
    assert limited.level == events_pb2.NOTICE_LEVEL_INFO
    assert limited.message.startswith(f"the remote critic sent {MAX_VERDICT_NOTICES} "
                                      "notices; its further warnings")
    assert "CRITIC_STOPPED" in codes  # a stop is never left out
    assert len(events) < MAX_VERDICT_NOTICES + 20  # not the flood
    # Every warning was applied and counted all the same.
    assert verdicts("warn", "remote") == warns + flood
    assert any(f"warn {flood}" in detail and f"{flood - MAX_VERDICT_NOTICES} notices left out"
               in detail for detail in await audit_details(server))
