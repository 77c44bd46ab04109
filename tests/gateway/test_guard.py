"""What other web pages can make a browser ask of the gateway: nothing.

A page on another origin reaches ``127.0.0.1`` through the visitor's browser: forms and
``no-cors`` fetches POST ``text/plain`` and form bodies without a preflight, and DNS
rebinding sends its own name as ``Host``. Each is refused on every route, with and without
authentication, while the page's own same-origin requests go through."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from tests.gateway.conftest import gateway_registry

EVIL = "http://attacker.example"

#: What a cross-origin page can send without a preflight, by Content-Type: the JSON a
#: route takes as ``text/plain`` (what ``<form enctype="text/plain">`` can be made to
#: post), and form bodies.
SIMPLE_BODIES = {
    "text/plain": "{json}",
    "application/x-www-form-urlencoded": "{json}=",
    "multipart/form-data; boundary=b": ('--b\r\nContent-Disposition: form-data; name="x"'
                                        '\r\n\r\n{json}\r\n--b--\r\n'),
}


@dataclass
class Front:
    http: httpx.AsyncClient
    origin: str
    auth: dict[str, str]


@pytest.fixture(params=["insecure-no-auth", "api-key"])
async def front(request, make_server, make_auth_server) -> AsyncIterator[Front]:
    """The gateway of a server started with ``insecure_no_auth``, or with an API key (which
    the attacks carry too: the guard does not lean on authentication)."""
    if request.param == "api-key":
        auth = await make_auth_server(registry=gateway_registry(), http_port=0)
        server, headers = auth.server, {"Authorization": f"Bearer {auth.key}"}
    else:
        server = await make_server(registry=gateway_registry(), http_port=0)
        headers = {}
    origin = f"http://127.0.0.1:{server.http.gateway_port}"
    async with httpx.AsyncClient(base_url=origin, timeout=30, headers=headers) as http:
        yield Front(http, origin, headers)


async def status_of(http: httpx.AsyncClient, method: str, url: str, **kwargs) -> int:
    """The status of a request, without reading the body (an event stream never ends)."""
    async with http.stream(method, url, **kwargs) as response:
        return response.status_code


async def start_staged(front: Front, gate: str) -> str:
    started = await front.http.post("/v1/tools/staged:execute", json={"arguments": {"gate": gate}},
                                    headers={"Origin": front.origin})
    assert started.status_code == 202, started.text
    return str(started.json()["run_id"])


async def test_cross_origin_simple_posts_are_refused_on_every_mutating_route(front, gate
                                                                           ) -> None:
    gate_name, opened = gate
    run_id = await start_staged(front, gate_name)
    mutating = {"/v1/tools/echo:execute?wait=true": '{"arguments": {"text": "pwned"}}',
                f"/v1/runs/{run_id}:cancel": '{"reason": "pwned"}',
                f"/v1/runs/{run_id}:steer": '{"message": "pwned"}',
                f"/v1/runs/{run_id}:approve": '{"approval_id": "x", "decision": "approve"}',
                "/v1/sessions": '{"kind": "python"}',
                "/v1/sessions/ses_0:close": "{}"}

    cross_origin, no_origin = {}, {}
    for url, json_text in mutating.items():
        for content_type, template in SIMPLE_BODIES.items():
            body = template.replace("{json}", json_text).encode()
            cross_origin[url, content_type] = (await front.http.post(url, content=body, headers={
                "Origin": EVIL, "Content-Type": content_type})).status_code
            # A browser that sent no Origin (or a plain client) still may not post forms.
            no_origin[url, content_type] = (await front.http.post(url, content=body, headers={
                "Content-Type": content_type})).status_code
        # Even JSON (which a page could only send after a preflight the gateway never
        # answers) and an empty body from a sandboxed page are refused.
        cross_origin[url, "json"] = (await front.http.post(
            url, json={"message": "x"}, headers={"Origin": EVIL})).status_code
        cross_origin[url, "empty"] = (await front.http.post(
            url, headers={"Origin": "null"})).status_code

    assert set(cross_origin.values()) == {403}, cross_origin
    assert set(no_origin.values()) == {415}, no_origin
    cross = await front.http.post("/v1/tools/echo:execute", content=b"{}",
                                  headers={"Origin": EVIL, "Content-Type": "text/plain"})
    assert cross.json()["error"]["status"] == "PERMISSION_DENIED"
    assert cross.headers["x-frame-options"] == "DENY"  # refusals carry the security headers

    # Nothing happened: one run (the test's), still going, and the page may still steer and
    # cancel it (the body-less cancel of a plain client included).
    listed = (await front.http.get("/v1/runs")).json()["runs"]
    assert [(r["tool_name"], r["state"]) for r in listed] == [("staged", "RUN_STATE_RUNNING")]
    assert (await front.http.get("/v1/sessions")).json()["sessions"] == []  # none opened
    steered = await front.http.post(f"/v1/runs/{run_id}:steer", json={"message": "go on"},
                                    headers={"Origin": front.origin})
    cancelled = await front.http.post(f"/v1/runs/{run_id}:cancel")
    assert steered.status_code == 200, steered.text
    assert cancelled.json() == {"cancelled": True}
    opened.set()


async def test_a_foreign_host_is_refused_on_every_route(front, gate) -> None:
    gate_name, _ = gate
    run_id = await start_staged(front, gate_name)
    port = front.origin.rsplit(":", 1)[1]
    reads = ["/", "/static/progress.js", "/v1/tools", "/v1/capabilities", "/v1/runs",
             "/v1/runs?state=running", "/v1/runs/events", f"/v1/runs/{run_id}/events",
             "/v1/sessions", "/v1/state/global", "/no-such-route"]
    writes = ["/v1/tools/echo:execute?wait=true", f"/v1/runs/{run_id}:steer",
              f"/v1/runs/{run_id}:cancel", f"/v1/runs/{run_id}:approve", "/v1/sessions"]

    for host in (f"attacker.example:{port}", "attacker.example", "localhost.attacker.example",
                 "127.0.0.1.nip.io", ""):
        # What a rebound page sends: its own name, its own origin (or none, for a GET).
        seen = [await status_of(front.http, "GET", url, headers={"Host": host})
                for url in reads]
        seen += [await status_of(front.http, "POST", url, json={"message": "x"},
                                 headers={"Host": host, "Origin": f"http://{host}"})
                 for url in writes]
        assert seen == [421] * len(seen), (host, seen)

    refused = await front.http.get("/v1/runs", headers={"Host": f"attacker.example:{port}"})
    assert refused.json()["error"]["status"] == "PERMISSION_DENIED"
    assert "http_allowed_hosts" in refused.json()["error"]["message"]
    listed = (await front.http.get("/v1/runs")).json()["runs"]
    assert [r["state"] for r in listed] == ["RUN_STATE_RUNNING"]  # the writes did nothing


async def test_the_page_and_plain_clients_still_pass(front) -> None:
    port = front.origin.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1", f"[::1]:{port}"):
        page = await front.http.get("/", headers={"Host": host})
        assert page.status_code == 200, (host, page.text)

    # The page's own requests: same-origin JSON POSTs (a browser names the origin) and GETs.
    same_origin = {"Origin": front.origin}
    ran = await front.http.post("/v1/tools/echo:execute?wait=true", headers=same_origin,
                                json={"arguments": {"text": "hi"}})
    assert ran.status_code == 200, ran.text
    typed = await front.http.post(
        "/v1/tools/echo:execute?wait=true", content=b'{"arguments": {"text": "typed"}}',
        headers={**same_origin, "Content-Type": "application/json; charset=utf-8"})
    assert typed.json()["result"]["output"] == "typed"
    assert (await front.http.get("/v1/capabilities", headers=same_origin)).status_code == 200
    events = await status_of(front.http, "GET", ran.json()["events_url"],
                             headers={**same_origin, "Accept": "text/event-stream"})
    assert events == 200
    listed = await front.http.get("/v1/runs", headers={"Host": f"localhost:{port}",
                                                        "Origin": f"http://localhost:{port}"})
    assert [r["tool_name"] for r in listed.json()["runs"]] == ["echo", "echo"]


async def test_allowed_hosts_and_origins_are_configurable(make_server) -> None:
    server = await make_server(registry=gateway_registry(), http_port=0,
                               http_allowed_hosts="tools.example.com,*.corp.example",
                               http_allowed_origins="https://tools.example.com")
    base = f"http://127.0.0.1:{server.http.gateway_port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        named = await http.get("/v1/runs", headers={"Host": "tools.example.com"})
        below = await http.get("/v1/runs", headers={"Host": "a.corp.example:8443"})
        other = await http.get("/v1/runs", headers={"Host": "corp.example"})
        # Behind a TLS proxy that rewrites Host: the public origin is allowed by name.
        proxied = await http.post("/v1/tools/echo:execute?wait=true",
                                  json={"arguments": {"text": "via proxy"}},
                                  headers={"Origin": "https://tools.example.com"})
        cross = await http.post("/v1/tools/echo:execute?wait=true",
                                json={"arguments": {"text": "x"}},
                                headers={"Origin": "https://evil.corp.example"})

    assert (named.status_code, below.status_code, other.status_code) == (200, 200, 421)
    assert proxied.status_code == 200, proxied.text
    assert cross.status_code == 403


def test_malformed_allowlists_stop_start_up() -> None:
    from pydantic import ValidationError

    from stargrpc.settings import Settings

    for setting, value in (("http_allowed_hosts", "tools.example.com/x"),
                           ("http_allowed_hosts", "to*ls.example.com"),
                           ("http_allowed_origins", "tools.example.com"),
                           ("http_allowed_origins", "https://tools.example.com/path"),
                           ("http_trusted_proxies", "proxy.example.com")):
        with pytest.raises(ValidationError, match=setting):
            Settings.load(**{setting: value})


async def test_the_mcp_endpoint_refuses_the_same(make_server) -> None:
    server = await make_server(registry=gateway_registry(), mcp_port=0,
                               http_allowed_hosts="mcp.example.com")
    assert server.mcp is not None
    url = f"http://127.0.0.1:{server.mcp.port}/mcp"
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(timeout=30) as http:
        rebound = await http.post(url, json=hello, headers={**accept, "Host": "attacker.example"})
        cross = await http.post(url, json=hello, headers={**accept, "Origin": EVIL})
        form = await http.post(url, content=b"{}", headers={
            **accept, "Content-Type": "text/plain"})
        named = await status_of(http, "POST", url, json=hello,
                                headers={**accept, "Host": "mcp.example.com"})

    assert (rebound.status_code, cross.status_code, form.status_code) == (421, 403, 415)
    assert named == 200
