"""http_fetch through a real server, against real HTTP(S) servers on 127.0.0.1."""

from __future__ import annotations

import functools
import gzip
import ipaddress
import ssl
import threading
import tracemalloc
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, quote, urlsplit

import certifi
import grpc
import httpx
import pytest
from google.rpc import error_details_pb2

from stargrpc.egress import HttpPolicy, origin, vet_url
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.auth.certs import TestCA
from tests.helpers import as_dict, run_tool, status_details

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


@functools.cache
def double_gzip_bomb() -> bytes:
    """256 MB of zeros, gzipped twice: well under a kilobyte on the wire."""
    inner = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    layer = b"".join([inner.compress(zeros) for _ in range(256)] + [inner.flush()])
    return gzip.compress(layer, 9)


class Seen(NamedTuple):
    """One request a test web server received."""

    port: int
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Handler(BaseHTTPRequestHandler):
    """A few canned answers; records what it was asked.

    ``/redirect?to=LOCATION[&cookie=NAME=VALUE]`` answers 302 with that Location, sent as
    given (even when malformed), and sets the cookie.
    """

    seen: list[Seen] = []

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""

    def _send(self, status: int, body: bytes, content_type: str,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _route(self) -> None:
        length = int(self.headers.get("Content-Length", "0") or 0)
        body = self.rfile.read(length) if length else b""
        port = self.server.server_address[1]
        Handler.seen.append(Seen(port, self.command, self.path, dict(self.headers), body))
        if self.path.startswith("/redirect?"):
            query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
            extra = {"Location": query["to"][0]}
            if "cookie" in query:
                extra["Set-Cookie"] = query["cookie"][0] + "; Path=/"
            self._send(302, b"", "text/plain", extra)
        elif self.path == "/hello":
            self._send(200, "héllo, wörld\n".encode(), "text/plain; charset=utf-8",
                       {"X-Test": "yes"})
        elif self.path == "/gzip":
            self._send(200, gzip.compress("héllo, gzip\n".encode()), "text/plain; charset=utf-8",
                       {"Content-Encoding": "gzip"})
        elif self.path == "/gzip-big":
            self._send(200, gzip.compress(b"z" * 90_000), "text/plain",
                       {"Content-Encoding": "gzip"})
        elif self.path == "/raw-deflate":
            squeeze = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
            body = squeeze.compress(b"raw deflate " * 1000) + squeeze.flush()
            self._send(200, body, "text/plain", {"Content-Encoding": "deflate"})
        elif self.path == "/broken-gzip":
            self._send(200, b"\x1f\x8b not really gzip", "text/plain",
                       {"Content-Encoding": "gzip"})
        elif self.path == "/bomb":
            self._send(200, double_gzip_bomb(), "text/plain", {"Content-Encoding": "gzip, gzip"})
        elif self.path == "/punycode":
            self._send(200, b"a" * 3000 + b"-" + b"b" * 3000, "text/plain; charset=PunyCode")
        elif self.path == "/image.png" or self.path.startswith("/files/"):
            self._send(200, PNG, "image/png")
        elif self.path == "/echo":
            self._send(201, b"got " + body, "text/plain")
        elif self.path == "/big":
            self._send(200, b"x" * 300_000, "text/plain")
        elif self.path == "/to-hello":
            self._send(302, b"", "text/plain", {"Location": f"http://127.0.0.1:{port}/hello"})
        elif self.path == "/to-metadata":
            self._send(302, b"", "text/plain",
                       {"Location": "http://169.254.169.254/latest/meta-data/"})
        elif self.path == "/to-elsewhere":
            self._send(302, b"", "text/plain", {"Location": "http://elsewhere.example/"})
        elif self.path == "/loop":
            self._send(302, b"", "text/plain", {"Location": "/loop"})
        else:
            self._send(404, b"no such page", "text/plain")

    do_GET = do_POST = do_HEAD = _route


def _serve(tls: ssl.SSLContext | None = None) -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


@pytest.fixture
def web() -> Iterator[ThreadingHTTPServer]:
    Handler.seen = []
    yield from _serve()


@pytest.fixture
def other_web(web) -> Iterator[ThreadingHTTPServer]:
    """A second web server: same host, another port (another origin)."""
    yield from _serve()


@pytest.fixture
def tls_web(web, tmp_path: Path, monkeypatch) -> Iterator[ThreadingHTTPServer]:
    """An HTTPS server for 127.0.0.1 whose CA http_fetch's client trusts in this test."""
    ca = TestCA()
    files = ca.server_files(tmp_path)
    monkeypatch.setattr(certifi, "where", lambda: str(files["tls_client_ca_file"]))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files["tls_cert_file"], files["tls_key_file"])
    yield from _serve(context)


ALLOW = {"http_fetch_allowlist": ["127.0.0.1", "localhost", "169.254.169.254", "10.1.2.3"],
         "http_fetch_max_bytes": 100_000, "http_fetch_max_redirects": 3}


@pytest.fixture
async def stub(make_server):
    """A server that allows the local test web server explicitly (127.0.0.1/32 only)."""
    server = await make_server(**ALLOW, http_fetch_allowed_networks=["127.0.0.1/32"])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


@pytest.fixture
async def strict_stub(make_server):
    """A server with the default address rules (no private network allowed)."""
    server = await make_server(**ALLOW)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


def url(web: ThreadingHTTPServer, path: str) -> str:
    return f"http://127.0.0.1:{web.server_address[1]}{path}"


async def test_get_returns_status_headers_and_text(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/hello")})

    steps = [(e.step.phase, e.step.step.title, e.step.delta) for e in events if e.HasField("step")]
    assert steps[1] == (events_pb2.STEP_PHASE_START, f"GET {url(web, '/hello')}", "")
    assert steps[2] == (events_pb2.STEP_PHASE_DELTA, "", "HTTP 200 OK\n")
    assert any(e.HasField("heartbeat") and e.heartbeat.progress == 1.0 for e in events)
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert result.output == "HTTP 200 OK\n\nhéllo, wörld\n"
    structured = as_dict(result)["structured_output"]
    assert structured["status"] == 200
    assert structured["headers"]["x-test"] == "yes"
    assert structured["body"] == "héllo, wörld\n"


async def test_post_sends_headers_and_body(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {
        "url": url(web, "/echo"), "method": "POST", "body": "ping",
        "headers": {"X-Token": "abc", "Host": "evil.example"}})

    assert events[-1].result.output == "HTTP 201 Created\n\ngot ping"
    _, method, _, headers, body = Handler.seen[-1]
    assert (method, body, headers["X-Token"]) == ("POST", b"ping", "abc")
    assert headers["Host"] == f"127.0.0.1:{web.server_address[1]}"  # never the caller's


async def test_binary_body_comes_back_as_a_file(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/image.png")})

    result = events[-1].result
    [sent] = result.writeback.sent_files
    assert (sent.name, sent.mime_type, sent.content) == ("image.png", "image/png", PNG)
    assert as_dict(result)["structured_output"]["body"] is None


async def test_redirect_on_an_allowed_host_is_followed(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/to-hello")})

    deltas = [e.step.delta for e in events if e.step.phase == events_pb2.STEP_PHASE_DELTA]
    assert deltas == ["HTTP 302 Found\n", "HTTP 200 OK\n"]
    assert events[-1].result.output.endswith("héllo, wörld\n")


async def test_body_over_the_cap_fails(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/big")})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert result.error.message == "the response body (300000 bytes) is over the 100000 byte cap"


async def test_head_of_a_body_over_the_cap_answers_its_length(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/big"), "method": "HEAD"})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert as_dict(result)["structured_output"]["headers"]["content-length"] == "300000"
    assert Handler.seen[-1].method == "HEAD"


async def test_compressed_bodies_are_decoded(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/gzip")})
    assert events[-1].result.output == "HTTP 200 OK\n\nhéllo, gzip\n"

    events = await run_tool(stub, "http_fetch", {"url": url(web, "/raw-deflate")})
    assert events[-1].result.output == "HTTP 200 OK\n\n" + "raw deflate " * 1000

    events = await run_tool(stub, "http_fetch", {"url": url(web, "/broken-gzip")})
    result = events[-1].result
    assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_FAILED, "HTTP_ERROR")
    assert "gzip coding is broken" in result.error.message


async def test_progress_of_a_compressed_body_stays_between_0_and_1(stub, web) -> None:
    # Counted against Content-Length, which is the body's size before decoding: 90 kB of
    # text gzipped to a few hundred bytes once reported progress 100 and more.
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/gzip-big")})

    progress = [e.heartbeat.progress for e in events
                if e.HasField("heartbeat") and e.heartbeat.HasField("progress")]
    assert len(progress) >= 2 and progress[-1] == 1.0
    assert all(0.0 <= p <= 1.0 for p in progress), progress
    assert events[-1].result.output == "HTTP 200 OK\n\n" + "z" * 90_000


async def test_a_compression_bomb_stops_at_the_cap_without_inflating_it(stub, web) -> None:
    # Less than a kilobyte gzipped twice: httpx inflated each layer of a chunk at once,
    # 256 MB here (gigabytes from a few kilobytes more) before the cap was looked at.
    double_gzip_bomb()
    tracemalloc.start()
    try:
        events = await run_tool(stub, "http_fetch", {"url": url(web, "/bomb")})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    result = events[-1].result
    assert result.error.message == "the response body is over the 100000 byte cap"
    assert peak < 32 * 1024 * 1024
    await assert_still_serving(stub, web)


async def test_a_body_in_punycode_is_not_decoded_but_sent_as_a_file(stub, web) -> None:
    # Python's punycode decoder is quadratic: a 5 MB body would hold the event loop for
    # minutes. Such a body comes back as bytes, in a file.
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/punycode")})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert as_dict(result)["structured_output"]["body"] is None
    [sent] = result.writeback.sent_files
    assert sent.content == b"a" * 3000 + b"-" + b"b" * 3000


@pytest.mark.parametrize(("path", "name"), [
    ("/files/%2e%2e", "download"), ("/files/%2E", "download"), ("/files/", "download"),
    ("/files/a%00b%0Ac.png", "a_b_c.png"), ("/files/..%5C..%5Cboot.ini", ".._.._boot.ini"),
    ("/files/x%2F..", "download"), ("/files/%1b%5b2Jx", "_[2Jx")])
async def test_a_body_is_sent_under_a_name_that_names_one_file(stub, web, path, name) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, path)})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    [sent] = result.writeback.sent_files
    assert sent.name == name


async def test_redirect_loop_stops_at_the_cap(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/loop")})

    assert events[-1].result.error.message == "more than 3 redirects"


REFUSALS = {
    "loopback": ("http://127.0.0.1:{port}/hello", "refused: 127.0.0.1 is a loopback address"),
    "metadata": ("http://169.254.169.254/latest/meta-data/",
                 "refused: 169.254.169.254 is a cloud metadata address"),
    "private": ("http://10.1.2.3/", "refused: 10.1.2.3 is a private address"),
    "name resolving to loopback": ("http://localhost:{port}/hello",
                                   "refused: localhost resolves to 127.0.0.1, a loopback "
                                   "address"),
    "not allowlisted": ("http://example.com/", "refused: example.com is not on the "
                        "http_fetch allowlist"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_forbidden_targets_are_refused_with_the_reason(strict_stub, web, case) -> None:
    target, reason = REFUSALS[case]
    events = await run_tool(strict_stub, "http_fetch",
                            {"url": target.format(port=web.server_address[1])})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_DENIED
    assert result.error.message == reason
    assert Handler.seen == []  # nothing reached the web server


@pytest.mark.parametrize(("path", "reason"), [
    ("/to-metadata", "refused: 169.254.169.254 is a cloud metadata address (redirect hop 1)"),
    ("/to-elsewhere", "refused: elsewhere.example is not on the http_fetch allowlist "
                      "(redirect hop 1)"),
])
async def test_a_redirect_to_a_forbidden_target_is_refused(stub, web, path, reason) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, path)})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_DENIED
    assert result.error.message == reason
    assert [seen.path for seen in Handler.seen] == [path]


def redirect(web: ThreadingHTTPServer, location: str, cookie: str | None = None) -> str:
    """A URL of ``web`` that redirects to ``location``."""
    query = "to=" + quote(location, safe="")
    if cookie is not None:
        query += "&cookie=" + quote(cookie, safe="")
    return url(web, f"/redirect?{query}")


CREDENTIALS = {"Authorization": "Bearer caller-secret", "Cookie": "session=caller-secret",
               "Proxy-Authorization": "Basic cHJveHk6c2VjcmV0", "X-Api-Key": "caller-secret"}


def request_target(address: str) -> str:
    """The path and query of ``address``, as the web server records them."""
    parts = urlsplit(address)
    return f"{parts.path}?{parts.query}" if parts.query else parts.path


def received(port: int, path: str = "/hello") -> dict[str, str]:
    """The headers of the one request to ``path`` on the server at ``port``."""
    [seen] = [s for s in Handler.seen if (s.port, s.path) == (port, path)]
    return seen.headers


async def assert_still_serving(stub, web) -> None:
    events = await run_tool(stub, "http_fetch", {"url": url(web, "/hello")})
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK


async def test_caller_headers_follow_a_same_origin_redirect_but_proxy_credentials_do_not(
        stub, web) -> None:
    start = redirect(web, url(web, "/hello"), cookie="sid=from-server")

    events = await run_tool(stub, "http_fetch", {"url": start, "headers": CREDENTIALS})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    first = received(web.server_address[1], request_target(start))
    assert first["Proxy-Authorization"] == CREDENTIALS["Proxy-Authorization"]
    headers = received(web.server_address[1])
    assert {k: headers.get(k) for k in ("Authorization", "X-Api-Key")} == {
        "Authorization": "Bearer caller-secret", "X-Api-Key": "caller-secret"}
    assert "session=caller-secret" in headers["Cookie"]
    assert "Proxy-Authorization" not in headers


async def test_a_redirect_to_another_port_drops_every_caller_header_and_cookie(
        stub, web, other_web) -> None:
    start = redirect(web, url(other_web, "/hello"), cookie="sid=from-server")

    events = await run_tool(stub, "http_fetch", {
        "url": start, "headers": {**CREDENTIALS, "Accept": "text/x-caller"}})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    headers = received(other_web.server_address[1])
    assert {k.lower() for k in headers} == {"host", "accept", "accept-encoding",
                                             "user-agent", "connection"}
    assert headers["Accept"] != "text/x-caller"
    assert headers["Host"] == f"127.0.0.1:{other_web.server_address[1]}"


async def test_an_https_to_http_redirect_drops_every_caller_header(stub, web, tls_web
                                                                      ) -> None:
    start = f"https://127.0.0.1:{tls_web.server_address[1]}/redirect?to=" + quote(
        url(web, "/hello"), safe="")

    events = await run_tool(stub, "http_fetch", {"url": start, "headers": CREDENTIALS})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert received(tls_web.server_address[1], request_target(start))["Authorization"] == (
        "Bearer caller-secret")
    headers = received(web.server_address[1])
    assert not set(CREDENTIALS) & set(headers)


def test_an_origin_is_scheme_host_and_port_with_default_ports_filled_in() -> None:
    same = [("https://h/", "https://h:443/x"), ("http://H./", "http://h:80/"),
            ("http://xn--bcher-kva.example/", "http://BÜCHER.example/")]
    different = [("https://h/", "http://h:443/"), ("https://h/", "https://h:8443/"),
                 ("http://h/", "http://h.example/"), ("http://h:80/", "https://h:80/")]

    assert all(origin(httpx.URL(a)) == origin(httpx.URL(b)) for a, b in same)
    assert all(origin(httpx.URL(a)) != origin(httpx.URL(b)) for a, b in different)


async def test_a_vetted_url_names_the_port_of_its_origin() -> None:
    policy = HttpPolicy(allowlist=("127.0.0.1", "::1"),
                        allowed_networks=(ipaddress.ip_network("127.0.0.0/8"),
                                          ipaddress.ip_network("::1/128")))
    cases = {"https://127.0.0.1/": "127.0.0.1", "http://127.0.0.1:8080/x": "127.0.0.1:8080",
             "http://[::1]:81/": "[::1]:81", "https://[::1]:443/": "[::1]"}
    for url, host_header in cases.items():
        target = await vet_url(url, policy)
        assert target.host_header == host_header
        assert target.request_url.port == target.url.port
        assert origin(target.request_url) == origin(target.url)


def test_allowlist_entries_match_every_spelling_of_a_name() -> None:
    policy = HttpPolicy(allowlist=("Bücher.example.", "*.xn--caf-dma.example", "::1"))

    assert policy.host_allowed("xn--bcher-kva.example")
    assert policy.host_allowed("BÜCHER.EXAMPLE.")
    assert policy.host_allowed("menu.café.example")
    assert policy.host_allowed("0:0::1")
    assert not policy.host_allowed("bucher.example")


BAD_SCHEMES = {
    "data": ("data:text/plain,hello", "a redirect to a data: URL is not followed"),
    "file": ("file:///etc/passwd", "a redirect to a file: URL is not followed"),
    "ftp": ("ftp://127.0.0.1/x", "a redirect to a ftp: URL is not followed"),
    "gopher": ("gopher://127.0.0.1:70/_x", "a redirect to a gopher: URL is not followed"),
    "javascript": ("javascript:alert(1)", "a redirect to a javascript: URL is not followed"),
    "scheme-relative": ("//127.0.0.1:{port}/hello",
                        "a scheme-relative redirect (//127.0.0.1:{port}/hello) is not followed"),
    "userinfo": ("http://user:pw@127.0.0.1:{port}/hello",
                 "a redirect to a URL with credentials in it is not followed"),
    "numeric IPv4": ("http://2130706433:{port}/hello",
                     "2130706433 is not an IPv4 address in the standard dotted form"),
}


@pytest.mark.parametrize("case", list(BAD_SCHEMES))
async def test_a_redirect_off_http_is_denied_with_the_reason(stub, web, case) -> None:
    location, reason = (text.format(port=web.server_address[1]) for text in BAD_SCHEMES[case])
    start = redirect(web, location)

    events = await run_tool(stub, "http_fetch", {"url": start})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_DENIED, result
    assert result.error.code == "BAD_URL"
    assert result.error.message.startswith("refused: " + reason)
    assert result.error.message.endswith(" (redirect hop 1)")
    assert [seen.path for seen in Handler.seen] == [request_target(start)]
    await assert_still_serving(stub, web)


MALFORMED = {
    "empty": ("", "the redirect has an empty Location"),
    "space": ("/a b", "holds whitespace, a control character or a backslash"),
    "tab": ("/a\tb", "holds whitespace, a control character or a backslash"),
    "backslash": ("/\\127.0.0.1/", "holds whitespace, a control character or a backslash"),
    "bad port": ("http://127.0.0.1:99999/", "is not a valid URL"),
    "unclosed bracket": ("http://[::1/", "is not a valid URL"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_redirect_fails_with_the_reason(stub, web, case) -> None:
    location, reason = MALFORMED[case]

    events = await run_tool(stub, "http_fetch", {"url": redirect(web, location)})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_FAILED, result
    assert result.error.code == "HTTP_BAD_REDIRECT"
    assert reason in result.error.message
    assert result.error.message.endswith(" (redirect hop 1)")
    assert len(Handler.seen) == 1
    await assert_still_serving(stub, web)


async def assert_denied_untouched(stub, target: str, reason: str) -> None:
    """Fetching ``target`` is DENIED with a reason starting ``reason``; no request is made."""
    events = await run_tool(stub, "http_fetch", {"url": target})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_DENIED, result
    assert result.error.message.startswith(reason)
    assert Handler.seen == []


def _v6(text: str) -> str:
    return str(ipaddress.ip_address(text))


# The IPv6 transition forms are judged by the IPv4 address they lead to, and allowing
# 127.0.0.1/32 (as the `stub` server does) does not allow reaching it through them.
REFUSED_FORM = "is not an IPv4 address in the standard dotted form (a.b.c.d in decimal)"
ODD_ADDRESSES = {
    "IPv4-compatible": ("[::127.0.0.1]", f"refused: {_v6('::127.0.0.1')} is an "
                        "IPv4-compatible address embedding 127.0.0.1 (a loopback address)"),
    "NAT64": ("[64:ff9b::127.0.0.1]", f"refused: {_v6('64:ff9b::127.0.0.1')} is a NAT64 "
              "address embedding 127.0.0.1 (a loopback address)"),
    "NAT64 to metadata": ("[64:ff9b::169.254.169.254]",
                          f"refused: {_v6('64:ff9b::169.254.169.254')} is a NAT64 address "
                          "embedding 169.254.169.254 (a cloud metadata address)"),
    "local-use NAT64": ("[64:ff9b:1::a01:203]",
                        "refused: 64:ff9b:1::a01:203 is a local-use NAT64 address"),
    "6to4": ("[2002:7f00:1::1]", "refused: 2002:7f00:1::1 is a 6to4 address embedding "
             "127.0.0.1 (a loopback address)"),
    "6to4 private": ("[2002:a01:203::1]", "refused: 2002:a01:203::1 is a 6to4 address "
                     "embedding 10.1.2.3 (a private address)"),
    "Teredo": ("[2001:0:4136:e378:8000:63bf:80ff:fffe]",
               "refused: 2001:0:4136:e378:8000:63bf:80ff:fffe is a Teredo address embedding "
               "127.0.0.1 (a loopback address)"),
    "unspecified IPv4": ("0.0.0.0", "refused: 0.0.0.0 is "),
    "unspecified IPv6": ("[::]", "refused: :: is "),
    "decimal IPv4": ("2130706433", f"refused: 2130706433 {REFUSED_FORM}"),
    "hex IPv4": ("0x7f.1", f"refused: 0x7f.1 {REFUSED_FORM}"),
    "short IPv4": ("127.1", f"refused: 127.1 {REFUSED_FORM}"),
    "zero": ("0", f"refused: 0 {REFUSED_FORM}"),
    "octal IPv4": ("0177.0.0.1", "not a valid URL: Invalid IPv4 address: '0177.0.0.1'"),
    "octal IPv4, short": ("0177.1", f"refused: 0177.1 {REFUSED_FORM}"),
    "zone id": ("[fe80::1%25lo]", "refused: fe80::1%25lo has a zone id; IPv6 zone ids are "
                "not fetched"),
}


@pytest.fixture
async def odd_stub(make_server):
    """Every host of ODD_ADDRESSES on the allowlist; 127.0.0.1/32 allowed."""
    hosts = [host.strip("[]").replace("%25", "%") for host, _ in ODD_ADDRESSES.values()]
    server = await make_server(http_fetch_allowlist=["127.0.0.1", *hosts],
                               http_fetch_allowed_networks=["127.0.0.1/32"])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


@pytest.mark.parametrize("case", list(ODD_ADDRESSES))
async def test_addresses_in_disguise_are_judged_by_what_they_reach(odd_stub, web,
                                                                   case) -> None:
    host, reason = ODD_ADDRESSES[case]

    await assert_denied_untouched(odd_stub, f"http://{host}:{web.server_address[1]}/hello",
                                  reason)
    await assert_still_serving(odd_stub, web)


@pytest.mark.parametrize(("host", "reason"), [
    ("127.0.0.1.", "refused: 127.0.0.1 is a loopback address"),
    ("LOCALHOST.", "refused: localhost resolves to 127.0.0.1, a loopback address"),
    ("ⓛocalhost", "not a valid URL: Invalid IDNA hostname"),
    ("l\N{CYRILLIC SMALL LETTER O}calhost",
     "refused: xn--lcalhost-nbh is not on the http_fetch allowlist"),
])
async def test_other_spellings_of_a_host_are_judged_as_that_host(strict_stub, web, host,
                                                                  reason) -> None:
    await assert_denied_untouched(strict_stub,
                                  f"http://{host}:{web.server_address[1]}/hello", reason)


async def test_a_trailing_dot_reaches_the_host_under_its_plain_name(stub, web) -> None:
    events = await run_tool(stub, "http_fetch",
                            {"url": f"http://127.0.0.1.:{web.server_address[1]}/hello"})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert received(web.server_address[1])["Host"] == f"127.0.0.1:{web.server_address[1]}"


@pytest.mark.parametrize(("headers", "reason"), [
    ({"X-Name": "caf\u00e9"}, "header X-Name holds a line break, a control character or "
                              "non-ASCII text"),
    ({"X-Split": "a\r\nX-Injected: 1"}, "header X-Split holds a line break"),
    ({"Bad Name": "x"}, "header name 'Bad Name' is not an HTTP token"),
])
async def test_headers_that_cannot_be_sent_are_refused_before_the_run(stub, web, headers,
                                                                      reason) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_tool(stub, "http_fetch", {"url": url(web, "/hello"), "headers": headers})

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = [v for d in status_details(caught.value)
                   if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations]
    assert violation.field == "arguments.headers"
    assert reason in violation.description
    assert Handler.seen == []
    await assert_still_serving(stub, web)
