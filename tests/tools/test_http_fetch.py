"""http_fetch through a real server, against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, run_tool

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


class Handler(BaseHTTPRequestHandler):
    """A few canned answers; records what it was asked."""

    seen: list[tuple[str, str, dict[str, str], bytes]] = []

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
        Handler.seen.append((self.command, self.path, dict(self.headers), body))
        port = self.server.server_address[1]
        if self.path == "/hello":
            self._send(200, "héllo, wörld\n".encode(), "text/plain; charset=utf-8",
                       {"X-Test": "yes"})
        elif self.path == "/image.png":
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


@pytest.fixture
def web() -> Iterator[ThreadingHTTPServer]:
    Handler.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


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
    method, _, headers, body = Handler.seen[-1]
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
    assert [p for _, p, _, _ in Handler.seen] == [path]
