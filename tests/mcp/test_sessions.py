"""MCP sessions of the streamable-HTTP endpoint, over raw HTTP: a session belongs to the
principal who opened it (another principal's POST, GET, DELETE or cancel notification is
answered like an unknown session), none is opened without valid credentials, and each
principal holds at most ``mcp_max_sessions_per_principal``."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest

from stargrpc.mcp.mapping import TOO_MANY_SESSIONS, UNAUTHENTICATED
from stargrpc.mcp.server import McpEndpoint
from stargrpc.mcp.sessions import MCP_AUDIT_METHOD
from stargrpc.server.interceptors.audit import AuditInterceptor
from tests.conftest import AuthServerFactory
from tests.helpers import eventually
from tests.mcp.conftest import McpUnderTest
from tests.mcp.mcp_tools import mcp_registry

#: The handshake-era version the raw sessions speak.
HANDSHAKE = "2025-11-25"
MODERN = "2026-07-28"
ACCEPT = "application/json, text/event-stream"
#: The envelope of a 2026-07-28 request.
MODERN_META = {"io.modelcontextprotocol/protocolVersion": MODERN,
               "io.modelcontextprotocol/clientCapabilities": {},
               "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"}}


@dataclass
class Answer:
    """An HTTP answer: its status, content type, session id header and JSON-RPC messages."""

    status: int
    content_type: str
    session: str | None
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, str, list[dict[str, Any]]]:
        """What a caller can tell two answers apart by."""
        return self.status, self.content_type, self.messages


async def _messages(response: httpx2.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON-RPC messages of a JSON or SSE response body."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip():
                yield json.loads(line[5:])
    elif response.headers.get("content-type", "").startswith("application/json"):
        body = await response.aread()
        if body:
            yield json.loads(body)


@dataclass
class Raw:
    """A raw MCP caller: a key, the session it speaks in (if any) and a protocol version."""

    http: httpx2.AsyncClient
    url: str
    key: str | None
    session: str | None = None
    version: str = HANDSHAKE
    origin: str | None = None

    def headers(self, session: str | None = None, method: str | None = None
                ) -> dict[str, str]:
        headers = {"Accept": ACCEPT, "Content-Type": "application/json",
                   "MCP-Protocol-Version": self.version}
        if self.version == MODERN and method is not None:
            headers["Mcp-Method"] = method  # 2026-07-28 routes by headers too
        if self.key is not None:
            headers["Authorization"] = f"Bearer {self.key}"
        if session or self.session:
            headers["Mcp-Session-Id"] = session or self.session or ""
        if self.origin is not None:
            headers["Origin"] = self.origin
        return headers

    @asynccontextmanager
    async def stream(self, method: str, body: dict[str, Any] | None = None,
                     session: str | None = None) -> AsyncIterator[httpx2.Response]:
        headers = self.headers(session, body.get("method") if body else None)
        async with self.http.stream(method, self.url, json=body,
                                    headers=headers) as response:
            yield response

    async def send(self, method: str, body: dict[str, Any] | None = None,
                   session: str | None = None) -> Answer:
        """One request; reads the answer up to the response to ``body`` (if a request)."""
        async with self.stream(method, body, session) as response:
            answer = Answer(response.status_code, response.headers.get("content-type", ""),
                            response.headers.get("mcp-session-id"))
            if method == "GET" and response.status_code == 200:
                return answer  # a standalone stream: it stays open, its status says it all
            async for message in _messages(response):
                answer.messages.append(message)
                if body is not None and message.get("id") == body.get("id") and (
                        "result" in message or "error" in message):
                    break
            return answer

    async def request(self, method: str, params: dict[str, Any] | None = None,
                      id: int = 1, session: str | None = None) -> Answer:
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
        if params is not None:
            body["params"] = params
        return await self.send("POST", body, session)

    async def notify(self, method: str, params: dict[str, Any] | None = None,
                     session: str | None = None) -> Answer:
        body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            body["params"] = params
        return await self.send("POST", body, session)

    async def initialize(self) -> Answer:
        """initialize (then notifications/initialized); the session is kept on success."""
        answer = await self.request("initialize", {
            "protocolVersion": self.version, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"}})
        if answer.status < 400 and answer.session:
            self.session = answer.session
            assert (await self.notify("notifications/initialized")).status == 202
        return answer

    async def echo(self, text: str, id: int = 50) -> str:
        answer = await self.request("tools/call", {"name": "echo", "arguments": {"text": text}},
                                    id=id)
        assert answer.status == 200, answer
        result = answer.messages[-1]["result"]
        return str(result["content"][0]["text"])


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(timeout=30) as client:
        yield client


def _endpoint(server: McpUnderTest) -> McpEndpoint:
    assert server.auth.server.mcp is not None
    return server.auth.server.mcp


async def _alice_and_bob(server: McpUnderTest, http: httpx2.AsyncClient) -> tuple[Raw, Raw]:
    """Alice (the admin key) with an open session, and Bob, with a valid key of his own."""
    alice = Raw(http, server.url, server.auth.key)
    assert (await alice.initialize()).status == 200
    bob = Raw(http, server.url, server.auth.add_key("bob"))
    return alice, bob


# -- another principal's use of a session ---------------------------------------------------

BOB_TRIES = {
    "POST tools/call": ("POST", {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                                 "params": {"name": "echo", "arguments": {"text": "bob"}}}),
    "POST tools/list": ("POST", {"jsonrpc": "2.0", "id": 9, "method": "tools/list"}),
    "GET": ("GET", None),
    "DELETE": ("DELETE", None),
}


@pytest.mark.parametrize("attempt", list(BOB_TRIES))
async def test_another_principal_is_answered_like_an_unknown_session(
        mcp_server: McpUnderTest, http: httpx2.AsyncClient, attempt: str) -> None:
    alice, bob = await _alice_and_bob(mcp_server, http)
    method, body = BOB_TRIES[attempt]

    with_hers = await bob.send(method, body, session=alice.session)
    with_unknown = await bob.send(method, body, session=uuid.uuid4().hex)

    assert with_hers.shape == with_unknown.shape
    assert with_hers.status == 404
    assert with_hers.session is None
    # her session is untouched: it still serves her, her standalone stream included
    assert await alice.echo("still mine") == "still mine"
    async with alice.stream("GET") as stream:
        assert stream.status_code == 200
    assert (await alice.send("DELETE")).status == 200


async def test_another_principals_cancel_does_not_end_her_run(
        mcp_server: McpUnderTest, http: httpx2.AsyncClient,
        gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, opened, cancelled = gate
    alice, bob = await _alice_and_bob(mcp_server, http)
    waiting = asyncio.Event()
    result: dict[str, Any] = {}

    async def call() -> None:
        body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
            "name": "wait_at_gate", "arguments": {"gate": name}, "_meta": {"progressToken": 1}}}
        async with alice.stream("POST", body) as response:
            async for message in _messages(response):
                if "waiting at the gate" in str(message.get("params", {}).get("message")):
                    waiting.set()
                if message.get("id") == 7:
                    result.update(message)
                    return

    calling = asyncio.create_task(call())
    await asyncio.wait_for(waiting.wait(), 20)
    cancel = {"requestId": 7, "reason": "bob says stop"}
    refused = await bob.notify("notifications/cancelled", cancel, session=alice.session)
    unknown = await bob.notify("notifications/cancelled", cancel, session=uuid.uuid4().hex)
    # the same notification on the 2026-07-28 wire, which has no sessions: dropped
    modern = Raw(http, mcp_server.url, bob.key, version=MODERN)
    dropped = await modern.notify("notifications/cancelled", cancel, session=alice.session)
    # her next request is read after his notification would have been: a sequence point
    assert (await alice.request("ping", id=8)).status == 200
    opened.set()
    await asyncio.wait_for(calling, 20)

    assert refused.shape == unknown.shape and refused.status == 404
    assert dropped.status == 202
    assert not cancelled.is_set()
    assert result["result"]["_meta"]["stargrpc.dev/outcome"] == "OK"
    assert result["result"]["content"] == [{"type": "text", "text": "through the gate"}]
    assert await alice.echo("after") == "after"


async def test_on_the_2026_wire_another_principal_cannot_cancel_her_call(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    """2026-07-28 has no sessions: cancelling is closing one's own response stream, and a
    notification POST is dropped, whoever sends it."""
    name, opened, cancelled = gate
    waiting = asyncio.Event()
    bob_key = mcp_server.auth.add_key("bob")

    async def progress(value: float, total: float | None, message: str | None) -> None:
        if message and "waiting at the gate" in message:
            waiting.set()

    async with mcp_server.client(mode=MODERN) as client, httpx2.AsyncClient(timeout=30) as http:
        call = asyncio.create_task(
            client.call_tool("wait_at_gate", {"gate": name}, progress_callback=progress))
        await asyncio.wait_for(waiting.wait(), 20)
        bob = Raw(http, mcp_server.url, bob_key, version=MODERN)
        answers = [await bob.notify("notifications/cancelled", {"requestId": request_id})
                   for request_id in range(10)]
        alice = Raw(http, mcp_server.url, mcp_server.auth.key, version=MODERN)
        assert (await alice.request("tools/list", {"_meta": MODERN_META})).status == 200
        opened.set()
        result = await asyncio.wait_for(call, 20)

    assert {answer.status for answer in answers} == {202}
    assert not cancelled.is_set()
    assert result.content == [types.TextContent(text="through the gate")]


# -- credentials before anything is created ---------------------------------------------------

@pytest.mark.parametrize("key", [None, "sgk_made_up_key", "not-a-key-at-all",
                                 "eyJhbGciOiJIUzI1NiJ9.e30.x"])
async def test_initialize_without_valid_credentials_opens_no_session(
        mcp_server: McpUnderTest, http: httpx2.AsyncClient, key: str | None) -> None:
    endpoint = _endpoint(mcp_server)
    stranger = Raw(http, mcp_server.url, key)

    answers = await asyncio.gather(*(stranger.initialize() for _ in range(20)))

    for answer in answers:
        assert answer.status == 401
        assert answer.session is None
        assert answer.messages[0]["error"]["code"] == UNAUTHENTICATED
    assert endpoint.sessions.count() == 0
    # and the endpoint keeps serving
    alice = Raw(http, mcp_server.url, mcp_server.auth.key)
    assert (await alice.initialize()).status == 200
    assert endpoint.sessions.count() == 1
    assert await alice.echo("hello") == "hello"


async def test_a_wrong_key_is_refused_on_every_route(mcp_server: McpUnderTest,
                                                      http: httpx2.AsyncClient) -> None:
    alice = Raw(http, mcp_server.url, mcp_server.auth.key)
    await alice.initialize()
    stranger = Raw(http, mcp_server.url, "sgk_made_up_key", session=alice.session)

    answers = [await stranger.request("tools/list"), await stranger.send("GET"),
               await stranger.send("DELETE"),
               await Raw(http, mcp_server.url, "sgk_made_up_key", version=MODERN).request(
                   "tools/list", {"_meta": MODERN_META})]

    assert [answer.status for answer in answers] == [401] * 4
    assert await alice.echo("still mine") == "still mine"


async def test_a_request_refused_for_its_credentials_is_audited(
        mcp_server: McpUnderTest, http: httpx2.AsyncClient) -> None:
    audit = next(i for i in mcp_server.auth.server.interceptors
                 if isinstance(i, AuditInterceptor))

    await Raw(http, mcp_server.url, None).initialize()
    await Raw(http, mcp_server.url, "sgk_made_up_key").send("DELETE")

    await audit.writer.flush()
    records = [r async for r in audit.writer.store.scan()
               if r.method.startswith(MCP_AUDIT_METHOD)]
    assert [(r.method, r.outcome, r.detail, r.peer) for r in records] == [
        (f"{MCP_AUDIT_METHOD}/POST", "unauthenticated", "UNAUTHENTICATED: missing",
         "ipv4:127.0.0.1"),
        (f"{MCP_AUDIT_METHOD}/DELETE", "unauthenticated", "UNAUTHENTICATED: malformed_key",
         "ipv4:127.0.0.1")]
    assert all(r.principal == "" for r in records)


# -- how many sessions a principal holds ------------------------------------------------------

async def test_a_principal_holds_at_most_its_share_of_sessions(
        make_auth_server: AuthServerFactory, http: httpx2.AsyncClient) -> None:
    server = McpUnderTest(await make_auth_server(
        mcp_registry(), mcp_port=0, mcp_max_sessions_per_principal=2))
    endpoint = _endpoint(server)
    alice = [Raw(http, server.url, server.auth.key) for _ in range(3)]
    bob = Raw(http, server.url, server.auth.add_key("bob"))

    opened = await asyncio.gather(*(raw.initialize() for raw in alice))
    refused = [answer for answer in opened if answer.status != 200]
    assert len(refused) == 1 and refused[0].status == 429 and refused[0].session is None
    error = refused[0].messages[0]["error"]
    assert error["code"] == TOO_MANY_SESSIONS
    assert "at most 2" in error["message"] and "DELETE" in error["message"]
    assert endpoint.sessions.count("tester") == 2
    # another principal is not held back by hers
    assert (await bob.initialize()).status == 200

    # ending one (DELETE) makes room at once
    first, second = [raw for raw in alice if raw.session]
    assert (await first.send("DELETE")).status == 200
    again = Raw(http, server.url, server.auth.key)
    assert (await again.initialize()).status == 200
    assert await second.echo("still serving") == "still serving"
    assert await again.echo("me too") == "me too"


async def test_an_idle_session_gives_its_place_back(
        make_auth_server: AuthServerFactory, http: httpx2.AsyncClient) -> None:
    server = McpUnderTest(await make_auth_server(
        mcp_registry(), mcp_port=0, mcp_max_sessions_per_principal=1,
        mcp_session_idle_seconds=1.0))
    first = Raw(http, server.url, server.auth.key)
    assert (await first.initialize()).status == 200
    async with first.stream("GET") as standalone:  # in flight: not idle, however long
        assert standalone.status_code == 200
        assert (await Raw(http, server.url, server.auth.key).initialize()).status == 429

    async def opens() -> bool:
        return (await Raw(http, server.url, server.auth.key).initialize()).status == 200

    assert await eventually(opens, interval=0.1, what="a session after the idle one expired")
    assert (await first.request("tools/list")).status == 404  # it did expire


async def test_the_sessions_of_the_endpoint_are_capped(
        make_auth_server: AuthServerFactory, http: httpx2.AsyncClient) -> None:
    server = McpUnderTest(await make_auth_server(mcp_registry(), mcp_port=0,
                                                 mcp_max_sessions=2))
    keys = [server.auth.key, server.auth.add_key("bob"), server.auth.add_key("carol")]

    callers = [Raw(http, server.url, key) for key in keys]
    answers = [await caller.initialize() for caller in callers]

    assert [answer.status for answer in answers] == [200, 200, 503]
    assert answers[2].session is None
    assert (await callers[0].send("DELETE")).status == 200  # room again, and still serving
    assert (await callers[2].initialize()).status == 200
    assert await callers[2].echo("carol's turn") == "carol's turn"


# -- the Host/Origin check still guards the session routes ------------------------------------

@pytest.mark.parametrize("method", ["POST", "GET", "DELETE"])
async def test_a_page_on_another_origin_is_refused_even_with_a_valid_key(
        mcp_server: McpUnderTest, http: httpx2.AsyncClient, method: str) -> None:
    endpoint = _endpoint(mcp_server)
    alice = Raw(http, mcp_server.url, mcp_server.auth.key)
    await alice.initialize()
    page = Raw(http, mcp_server.url, mcp_server.auth.key, session=alice.session,
               origin="https://evil.example")

    opening = await Raw(http, mcp_server.url, mcp_server.auth.key,
                        origin="https://evil.example").initialize()
    body = ({"jsonrpc": "2.0", "id": 3, "method": "tools/list"} if method == "POST" else None)
    in_session = await page.send(method, body)
    modern = await Raw(http, mcp_server.url, mcp_server.auth.key, version=MODERN,
                       origin="https://evil.example").request(
        "tools/list", {"_meta": MODERN_META})

    assert opening.status == 403 and opening.session is None
    assert in_session.status == 403
    assert modern.status == 403
    assert endpoint.sessions.count() == 1
    assert await alice.echo("same origin") == "same origin"


async def test_a_browsers_preflight_from_another_origin_is_not_granted(
        mcp_server: McpUnderTest, http: httpx2.AsyncClient) -> None:
    answer = await http.options(mcp_server.url, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, mcp-session-id"})

    assert answer.status_code >= 400
    assert not any(name.startswith("access-control-allow") for name in answer.headers)
    assert _endpoint(mcp_server).sessions.count() == 0


async def test_stopping_the_server_ends_open_sessions(mcp_server: McpUnderTest,
                                                      http: httpx2.AsyncClient) -> None:
    alice = Raw(http, mcp_server.url, mcp_server.auth.key)
    await alice.initialize()
    endpoint = _endpoint(mcp_server)
    with anyio.fail_after(20):
        await mcp_server.auth.server.stop(grace=1.0)
    assert endpoint.sessions.count() == 0
