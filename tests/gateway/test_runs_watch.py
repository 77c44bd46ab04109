"""The live run list (GET /v1/runs/events): streams asking the same share one ListRuns poll."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from httpx_sse import aconnect_sse

from stargrpc.gateway import runs_watch
from stargrpc.gateway.runs_watch import RunListWatch
from tests.conftest import AuthServerFactory
from tests.gateway.conftest import GatewayUnderTest, gateway_registry
from tests.helpers import eventually

BOUND = 30.0


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runs_watch, "RUNS_WATCH_SECONDS", 0.1)


async def lists(gw: GatewayUnderTest, stack: contextlib.AsyncExitStack,
                **params: str) -> AsyncIterator[list[str]]:
    """The run ids of each ``runs`` event of one open stream."""
    source = await stack.enter_async_context(
        aconnect_sse(gw.http, "GET", "/v1/runs/events", params=params))
    assert source.response.status_code == 200
    events = source.aiter_sse()

    async def ids() -> AsyncIterator[list[str]]:
        async for message in events:
            if message.event == "runs":
                yield [run["run_id"] for run in json.loads(message.data)["runs"]]
    return ids()


async def until_listed(stream: AsyncIterator[list[str]], run_id: str) -> list[str]:
    async with asyncio.timeout(BOUND):
        async for ids in stream:
            if run_id in ids:
                return ids
    raise AssertionError("the stream ended")


async def test_streams_that_ask_the_same_share_one_poll_until_the_last_goes(
        gateway: GatewayUnderTest) -> None:
    assert gateway.server.http.gateway is not None
    watch: RunListWatch = gateway.server.http.gateway.runs_watch
    earlier = (await gateway.http.post("/v1/tools/echo:execute?wait=true",
                                       json={"arguments": {"text": "earlier"}})).json()
    async with contextlib.AsyncExitStack() as stack:
        first, second = [await lists(gateway, stack) for _ in range(2)]
        echoes = await lists(gateway, stack, tool="echo")
        others = await lists(gateway, stack, tool="count")
        shown = [await anext(stream) for stream in (first, second, echoes, others)]
        assert shown == [[earlier["run_id"]]] * 3 + [[]]
        assert watch.polls == 3  # all runs (two streams), echo runs, count runs

        added = (await gateway.http.post("/v1/tools/echo:execute?wait=true",
                                         json={"arguments": {"text": "added"}})).json()
        for stream in (first, second, echoes):
            assert (await until_listed(stream, added["run_id"]))[0] == added["run_id"]

    # The server notices each client went away on its own time: look, bounded.
    await eventually(lambda: watch.polls == 0, within=BOUND, interval=0.05,
                     what=lambda: f"every shared poll gone ({watch.polls} left)")
    assert watch.polls == 0


async def test_closing_the_gateway_ends_every_stream_of_a_shared_poll(
        gateway: GatewayUnderTest) -> None:
    async with contextlib.AsyncExitStack() as stack:
        streams = [await lists(gateway, stack) for _ in range(2)]
        for stream in streams:
            await anext(stream)
        await gateway.server.stop(grace=0)  # the gateway closes: the poll and its streams end

        for stream in streams:
            async with asyncio.timeout(BOUND):
                left = [ids async for ids in stream]
            assert left == []


async def test_closing_the_gateway_ends_a_stream_whose_poll_waits_for_list_runs(
        gateway: GatewayUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    # The poll's ListRuns is in flight (the server slow to answer) when the gateway closes:
    # the stream ends at once rather than when, or if, that answer comes.
    assert gateway.server.http.gateway is not None
    client = gateway.server.http.gateway.client
    asked, never = asyncio.Event(), asyncio.Event()

    async def unanswered(*_: object) -> object:
        asked.set()
        await never.wait()
        raise AssertionError("never answered")

    async with contextlib.AsyncExitStack() as stack:
        stream = await lists(gateway, stack)
        await anext(stream)
        monkeypatch.setattr(client, "list_runs", unanswered)
        async with asyncio.timeout(BOUND):
            await asked.wait()  # the poll is waiting for its answer now
        await gateway.server.stop(grace=0)

        async with asyncio.timeout(BOUND):
            left = [ids async for ids in stream]
        assert left == []


async def test_a_key_revoked_while_its_run_list_is_open_ends_the_stream_with_the_refusal(
        make_auth_server: AuthServerFactory) -> None:
    auth = await make_auth_server(gateway_registry(), roles=("admin",), http_port=0)
    base_url = f"http://127.0.0.1:{auth.server.http.gateway_port}"
    headers = {"authorization": f"Bearer {auth.key}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=30, headers=headers) as http, \
            aconnect_sse(http, "GET", "/v1/runs/events") as source:
        assert source.response.status_code == 200
        events = source.aiter_sse()
        assert (await anext(events)).event == "runs"
        auth.keys.revoke("tester")  # the next poll's ListRuns is refused

        async with asyncio.timeout(BOUND):
            rest = [message async for message in events if message.event != "runs"]

    assert [message.event for message in rest] == ["error"]
    assert json.loads(rest[0].data)["error"]["status"] == "UNAUTHENTICATED"


async def test_a_poll_that_fails_ends_its_streams_with_an_error(
        gateway: GatewayUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not a refusal from the server but the gateway's own failure: the stream is told
    # (an error event), not ended as if the gateway were closing.
    assert gateway.server.http.gateway is not None
    client = gateway.server.http.gateway.client

    async def broken(*_: object) -> object:
        raise ValueError("a bug in the gateway")

    async with aconnect_sse(gateway.http, "GET", "/v1/runs/events") as source:
        events = source.aiter_sse()
        assert (await anext(events)).event == "runs"
        monkeypatch.setattr(client, "list_runs", broken)
        async with asyncio.timeout(BOUND):
            rest = [message async for message in events if message.event != "runs"]

    assert [message.event for message in rest] == ["error"]
    assert json.loads(rest[0].data)["error"]["status"] == "INTERNAL"
