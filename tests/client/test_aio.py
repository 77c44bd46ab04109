"""AsyncClient against a real server: typed events, credentials, idempotency keys,
retries with backoff and RetryInfo, CATALOG_STALE reload, resume through WatchRun."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from stargrpc.client import (
    AsyncClient,
    CallError,
    Outcome,
    Result,
    ResumeError,
    RetryPolicy,
    StepDelta,
    StepEnded,
    StepStarted,
    ToolRunError,
)
from stargrpc.client.channel import KEEPALIVE_TIME_SECONDS, KEEPALIVE_TIMEOUT_SECONDS
from stargrpc.errors import CatalogStale, RequestError, ResourceExhausted, Unavailable
from stargrpc.registry import Registry, spec_of, tool
from stargrpc.server.grpc_server import StargrpcServer
from tests.client.conftest import FAST_RETRY
from tests.client.faults import Proxy, Recorder
from tests.client.garbled import BAD_ERROR_INFO, TRUNCATED, garbled_server
from tests.helpers import COUNT_TO_3, count_phases, phases


def _registry(*fns: object) -> Registry:
    specs = [spec_of(fn) for fn in fns]
    return Registry(spec for spec in specs if spec is not None)


class QuotaWithoutRetryInfo(RequestError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "QUOTA"


async def test_list_tools_returns_the_catalog_and_keeps_it(
        client: AsyncClient, recorded_server: StargrpcServer) -> None:
    catalog = await client.list_tools()

    assert {"count", "echo", "sleep"} <= set(catalog.names)
    assert catalog.catalog_hash == recorded_server.runtime.registry.catalog_hash
    count = catalog["count"]
    assert count.input_schema["properties"]["to"]["type"] == "integer"
    assert count.read_only and count.callable and not count.privileged
    assert client.catalog is catalog
    assert await client.list_tools() is catalog  # not modified: the server sent no tools


async def test_execute_yields_typed_events_in_order_ending_with_the_result(
        client: AsyncClient) -> None:
    events = [event async for event in client.execute("count", {"to": 3})]

    assert phases([e.raw for e in events]) == COUNT_TO_3
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert isinstance(events[0], StepStarted) and events[0].step.title == "count"
    assert isinstance(events[1], StepStarted) and events[1].step.parent_id == "s0"
    assert [e.text for e in events if isinstance(e, StepDelta)] == ["1\n", "2\n", "3\n"]
    ended = events[-2]
    assert isinstance(ended, StepEnded) and ended.step.status == "COMPLETE"
    assert ended.step.ended_at is not None and ended.step.started_at is not None
    result = events[-1]
    assert isinstance(result, Result)
    assert result.ok and result.outcome is Outcome.OK
    assert result.output == "counted to 3"
    assert result.raise_for_outcome() is result


async def test_call_returns_the_result_and_passes_every_event(client: AsyncClient) -> None:
    seen: list[int] = []

    result = await client.call("echo", {"text": "hi"}, on_event=lambda e: seen.append(e.seq))

    assert result.output == "hi"
    assert seen == [1, 2, 3, 4]


async def test_a_failed_run_is_a_result_not_an_exception(make_server) -> None:
    @tool()
    async def refuse(ctx) -> str:
        """Always fails."""
        return {"success": False, "error": "disk is full"}  # type: ignore[return-value]

    server = await make_server(registry=_registry(refuse))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        result = await AsyncClient(channel).call("refuse")

    assert result.outcome is Outcome.FAILED and not result.ok
    assert "disk is full" in result.error_message
    with pytest.raises(ToolRunError, match="FAILED") as raised:
        result.raise_for_outcome()
    assert raised.value.result is result


async def test_credentials_and_a_fresh_idempotency_key_go_with_every_call(
        client: AsyncClient, recorder: Recorder) -> None:
    await client.call("echo", {"text": "a"})
    await client.call("echo", {"text": "b"}, idempotency_key="mine-1")
    await client.list_tools()

    executes = recorder.seen("Execute")
    assert all(c.metadata["authorization"] == "Bearer test-key" for c in recorder.calls)
    first_key = executes[0].request.idempotency_key
    assert len(first_key) == 32
    assert executes[1].request.idempotency_key == "mine-1"
    assert executes[0].request.arguments_json == '{"text": "a"}'


async def test_raw_json_arguments_are_sent_as_written(client: AsyncClient,
                                                      recorder: Recorder) -> None:
    result = await client.call("count", '{"to": 2.0e0}')

    assert result.ok
    assert recorder.seen("Execute")[0].request.arguments_json == '{"to": 2.0e0}'


async def test_unavailable_is_retried_with_backoff_and_the_same_key(
        client: AsyncClient, recorder: Recorder) -> None:
    recorder.fail("Execute", Unavailable("draining"), times=2)

    events = [event async for event in client.execute("count", {"to": 3})]

    assert phases([e.raw for e in events]) == COUNT_TO_3
    attempts = recorder.seen("Execute")
    assert len(attempts) == 3
    assert len({a.request.idempotency_key for a in attempts}) == 1


async def test_unavailable_gives_up_after_the_policy_s_attempts(
        client: AsyncClient, recorder: Recorder) -> None:
    recorder.fail("Execute", Unavailable("down for good", reason="DRAINING"), times=10)

    with pytest.raises(CallError) as raised:
        await client.call("echo", {"text": "x"})

    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
    assert raised.value.reason == "DRAINING"
    assert len(recorder.seen("Execute")) == FAST_RETRY.max_attempts


async def test_steering_is_sent_once_even_when_it_fails_transiently(
        client: AsyncClient, recorder: Recorder) -> None:
    run_id = (await client.call("echo", {"text": "x"})).run_id
    recorder.fail("SteerRun", Unavailable("draining"))
    recorder.fail("CancelRun", Unavailable("draining"))

    with pytest.raises(CallError) as raised:
        await client.steer(run_id, "look left")
    cancelled = await client.cancel(run_id)  # idempotent: retried as usual

    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
    assert len(recorder.seen("SteerRun")) == 1
    assert len(recorder.seen("CancelRun")) == 2 and cancelled is False


async def test_retry_info_is_honoured(client: AsyncClient, recorder: Recorder) -> None:
    recorder.fail("Execute", ResourceExhausted("too many runs", retry_after=0.4))

    started = time.monotonic()
    result = await client.call("echo", {"text": "x"})

    assert result.ok
    assert len(recorder.seen("Execute")) == 2
    # A lower bound only: the client waited at least what the server asked for.
    assert time.monotonic() - started >= 0.4


async def test_resource_exhausted_without_retry_info_is_not_retried(
        client: AsyncClient, recorder: Recorder) -> None:
    recorder.fail("Execute", QuotaWithoutRetryInfo("quota"))

    with pytest.raises(CallError) as raised:
        await client.call("echo", {"text": "x"})

    assert raised.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.retry_delay is None
    assert len(recorder.seen("Execute")) == 1


async def test_refusals_are_not_retried_and_carry_their_details(
        client: AsyncClient, recorder: Recorder) -> None:
    with pytest.raises(CallError) as unknown:
        await client.call("no_such_tool")
    with pytest.raises(CallError) as invalid:
        await client.call("count", {"to": "many"})

    assert unknown.value.code is grpc.StatusCode.NOT_FOUND
    assert unknown.value.reason == "TOOL_NOT_FOUND"
    assert invalid.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in invalid.value.violations] == ["arguments.to"]
    assert len(recorder.seen("Execute")) == 2


async def test_stale_catalog_is_reloaded_and_the_call_retried_once(
        client: AsyncClient, recorded_server: StargrpcServer, recorder: Recorder) -> None:
    old = await client.list_tools()

    @tool()
    async def newcomer(ctx) -> str:
        """A tool that was not there when the client loaded the catalog."""
        return "new"

    registry = Registry([*recorded_server.runtime.registry.values(), *_registry(newcomer).values()])
    assert recorded_server.runtime.replace_registry(registry)

    result = await client.call("echo", {"text": "x"})

    assert result.ok
    attempts = recorder.seen("Execute")
    assert [a.request.catalog_hash for a in attempts] == [old.catalog_hash,
                                                          registry.catalog_hash]
    assert client.catalog is not None and "newcomer" in client.catalog
    assert client.catalog.catalog_hash == registry.catalog_hash


async def test_watch_catalog_follows_changes(client: AsyncClient,
                                             recorded_server: StargrpcServer) -> None:
    @tool()
    async def extra(ctx) -> str:
        """Added while the client watches."""
        return "x"

    catalogs = client.watch_catalog()
    first = await anext(catalogs)
    registry = Registry([*recorded_server.runtime.registry.values(),
                         *_registry(extra).values()])
    recorded_server.runtime.replace_registry(registry)
    second = await anext(catalogs)
    await catalogs.aclose()

    assert "extra" not in first and "extra" in second
    assert second.catalog_hash == registry.catalog_hash
    assert client.catalog is second


async def test_stale_twice_is_an_error(client: AsyncClient, recorder: Recorder) -> None:
    await client.list_tools()
    recorder.fail("Execute", CatalogStale("stale"), times=2)

    with pytest.raises(CallError) as raised:
        await client.call("echo", {"text": "x"})

    assert raised.value.reason == "CATALOG_STALE"
    assert len(recorder.seen("Execute")) == 2
    assert len(recorder.seen("ListTools")) == 2


async def test_broken_stream_resumes_through_watch_run_without_gap_or_duplicate(
        proxy: Proxy, recorder: Recorder) -> None:
    async with grpc.aio.insecure_channel(proxy.target) as channel:
        client = AsyncClient(channel, retry=FAST_RETRY)
        events = []
        async for event in client.execute("count", {"to": 8, "delay": 0.05}):
            events.append(event)
            if event.seq == 3:
                proxy.cut()  # the network fails; the server does not notice

    assert phases([e.raw for e in events]) == count_phases(8)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len({e.run_id for e in events}) == 1
    assert len(recorder.seen("Execute")) == 1  # the tool ran once
    watches = recorder.seen("WatchRun")
    assert watches, "the client resumed through WatchRun"
    assert watches[0].request.run_id == events[0].run_id
    assert watches[0].request.after_seq >= 3
    assert proxy.connections >= 2


async def test_watch_replays_after_a_seq_then_follows(client: AsyncClient) -> None:
    stream = client.execute("count", {"to": 4, "delay": 0.05})
    first = [await anext(stream), await anext(stream)]
    run_id = first[0].run_id

    watched = [event async for event in client.watch(run_id, after_seq=2)]
    rest = [event async for event in stream]

    assert [e.seq for e in watched] == [e.seq for e in rest] == list(range(3, 3 + len(rest)))
    assert phases([e.raw for e in first + watched]) == count_phases(4)
    assert [e.raw for e in watched] == [e.raw for e in rest]


async def test_watch_of_an_unknown_run_is_not_found(client: AsyncClient) -> None:
    with pytest.raises(CallError) as raised:
        async for _ in client.watch("0" * 32):
            pass
    assert raised.value.code is grpc.StatusCode.NOT_FOUND


async def test_cancel_ends_the_run_with_the_reason(client: AsyncClient) -> None:
    stream = client.execute("sleep", {"seconds": 30, "heartbeat_every": 0.05})
    first = await anext(stream)

    assert await client.cancel(first.run_id, "enough")
    result = [event async for event in stream][-1]
    assert await client.cancel(first.run_id) is False  # already over

    assert isinstance(result, Result)
    assert result.outcome is Outcome.CANCELLED
    assert "enough" in result.error_message


async def test_the_deadline_covers_the_whole_call(client: AsyncClient) -> None:
    # The server stops the run just before the caller's deadline (its supervision holds
    # whatever interceptors the server has): the caller gets that Result when the transport
    # still has time, DEADLINE_EXCEEDED otherwise — never a call that outlives its deadline.
    try:
        result = await client.call("sleep", {"seconds": 30}, timeout=0.5)
    except CallError as error:
        assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert (result.outcome, result.error_code) == (Outcome.TIMEOUT, "CLIENT_DEADLINE")


async def test_resume_gives_up_when_the_server_is_gone(make_server) -> None:
    server = await make_server()
    front = Proxy(server.port)
    await front.start()
    try:
        async with grpc.aio.insecure_channel(front.target) as channel:
            client = AsyncClient(channel, retry=RetryPolicy(max_attempts=3,
                                                            initial_backoff=0.02))
            stream = client.execute("sleep", {"seconds": 30, "heartbeat_every": 0.05})
            first = await anext(stream)
            await front.close()  # the network fails...
            await server.stop(grace=0)  # ...and the single-process server is gone, runs too

            with pytest.raises(ResumeError) as raised:
                async for _ in stream:
                    pass
    finally:
        await front.close()

    assert raised.value.run_id == first.run_id
    assert raised.value.last_seq >= 1


async def test_close_closes_only_an_owned_channel(recorded_server: StargrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{recorded_server.port}") as channel:
        await AsyncClient(channel).close()
        assert (await AsyncClient(channel).call("echo", {"text": "still open"})).ok

    async with AsyncClient.connect(f"127.0.0.1:{recorded_server.port}") as client:
        assert (await client.list_tools()).names
    with pytest.raises(Exception):  # noqa: B017 - grpc raises its own closed-channel error
        await client.list_tools()


def test_an_api_key_and_a_token_together_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        AsyncClient(None, api_key="a", token="b")  # type: ignore[arg-type]


def test_retry_policy_waits_at_least_what_retry_info_asks() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.1, max_backoff=1.0, jitter=0.0)
    plain = CallError(grpc.StatusCode.UNAVAILABLE, "x")
    told = CallError(grpc.StatusCode.UNAVAILABLE, "x", retry_delay=2.5)
    greedy = CallError(grpc.StatusCode.UNAVAILABLE, "x", retry_delay=3600)

    assert [policy.delay(n, plain) for n in (1, 2, 3)] == [0.1, 0.2, None]
    assert policy.delay(1, told) == 2.5
    assert policy.delay(1, greedy) is None
    assert policy.should_retry_call(plain)
    assert not policy.should_retry_call(CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x"))




async def test_a_connection_gone_silent_is_noticed_and_the_run_resumed(
        proxy: Proxy, recorder: Recorder) -> None:
    # No deadline: only the channel's keepalive can tell a silent server from a slow run
    # (it was missing, and such a call waited for ever).
    async with AsyncClient.connect(proxy.target, retry=FAST_RETRY) as client:
        events = []

        async def read() -> None:
            async for event in client.execute("count", {"to": 8, "delay": 0.05}):
                events.append(event)
                if event.seq == 3:
                    proxy.stall()  # a stopped server: nothing more arrives, nothing closes

        await asyncio.wait_for(read(), 3 * (KEEPALIVE_TIME_SECONDS + KEEPALIVE_TIMEOUT_SECONDS))

    assert phases([e.raw for e in events]) == count_phases(8)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len(recorder.seen("Execute")) == 1
    assert [w.request.after_seq for w in recorder.seen("WatchRun")] == [3]


async def test_refusal_details_that_do_not_read_still_give_a_call_error() -> None:
    # They raised protobuf's DecodeError out of the client: no CallError, no retry policy.
    for details in (TRUNCATED, BAD_ERROR_INFO):
        async with garbled_server(details) as target, \
                AsyncClient.connect(target, retry=FAST_RETRY) as client:
            with pytest.raises(CallError) as caught:
                await client.list_tools()
        assert (caught.value.code, caught.value.message) == (grpc.StatusCode.NOT_FOUND, "nope")
        assert caught.value.reason == ""
    assert [v.field for v in caught.value.violations] == ["tool_name"]  # what reads is kept
