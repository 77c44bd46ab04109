"""``stargrpc serve --http-port`` and ``STARGRPC_METRICS_PORT`` in a real server process:
the gateway, the page and the metrics answer on the ports the log names, and SIGTERM still
stops the process cleanly."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx

from stargrpc import http_server
from stargrpc.http_server import AsgiServer
from tests.procs import ServerProcess, serve


def bound_port(server: ServerProcess, what: str) -> int:
    line = server.wait_for(
        lambda entry: entry.get("event") == "http_serving" and entry.get("what") == what, 30)
    return int(str(line["address"]).rsplit(":", 1)[1])


def test_serve_starts_the_gateway_and_the_metrics_endpoint(tmp_path: Path) -> None:
    with serve(tmp_path, "--http-port", "0", STARGRPC_METRICS_PORT="0") as server:
        gateway = f"http://127.0.0.1:{bound_port(server, 'gateway')}"
        metrics = f"http://127.0.0.1:{bound_port(server, 'metrics')}"
        with httpx.Client(timeout=30) as http:
            page = http.get(f"{gateway}/")
            ran = http.post(f"{gateway}/v1/tools/echo:execute?wait=true",
                            json={"arguments": {"text": "from the CLI"}})
            scraped = http.get(f"{metrics}/metrics")
        status = server.stop()

    assert page.status_code == 200 and "live progress" in page.text
    assert ran.json()["result"]["output"] == "from the CLI"
    assert 'tool_executor_tasks_total{outcome="ok",tool="echo"} 1.0' in scraped.text
    assert status == 0


async def test_http_connections_send_without_waiting_for_acks(tmp_path: Path) -> None:
    # Nagle's algorithm off on every accepted connection: with it on, each response after
    # the first on a kept-alive connection waited for the client's delayed ACK (~40 ms).
    async def app(scope, receive, send) -> None:  # a minimal ASGI app
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server = AsgiServer("test", app, "127.0.0.1", 0)
    port = await server.start()
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(2):  # the same kept-alive connection
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
            assert server._server is not None
            accepted = [protocol.transport.get_extra_info("socket")
                        for protocol in server._server.server_state.connections]
            assert accepted
            assert all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                       for sock in accepted)
    finally:
        await server.stop()


async def test_a_request_that_does_not_come_whole_is_cut_off(monkeypatch) -> None:
    # uvicorn waits for ever for a request's head or body: a silent connection, a head sent
    # a byte at a time or a body announced and never finished each held a socket (and what
    # had come of the body) without any credentials asked.
    monkeypatch.setattr(http_server, "REQUEST_HEAD_SECONDS", 0.3)
    monkeypatch.setattr(http_server, "REQUEST_BODY_SECONDS", 0.6)
    disconnected = asyncio.Event()

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while True:  # the whole body, or the client gone
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
                return
            if not message.get("more_body"):
                break
        if scope["path"] == "/slow":  # a response may take its time
            await asyncio.sleep(1.0)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server = AsgiServer("test", app, "127.0.0.1", 0)
    port = await server.start()

    async def cut_off(sent: bytes) -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        try:
            return await asyncio.wait_for(reader.read(), 10) == b""
        finally:
            writer.close()

    try:
        assert await cut_off(b"")  # never a byte
        assert await cut_off(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no end of head
        assert await cut_off(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n"
                             b"\r\n{")  # no end of body
        await asyncio.wait_for(disconnected.wait(), 10)
        # A whole request is answered, however long its response takes, and its kept-alive
        # connection serves the next one.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.post("/slow", content=b"x" * 1000)).text == "ok"
            assert (await client.get("/")).text == "ok"
    finally:
        await server.stop()


async def test_a_port_serves_at_most_http_max_connections_at_once(caplog) -> None:
    # Each open connection holds a descriptor and memory: beyond the cap a request is
    # answered 503 at once, and a flood of them is one log line a minute, not one each.
    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server = AsgiServer("test", app, "127.0.0.1", 0, max_connections=2)
    port = await server.start()
    url = f"http://127.0.0.1:{port}/"
    try:
        async with httpx.AsyncClient() as first, httpx.AsyncClient() as second:
            # Two kept-alive connections, each open once its first answer is in.
            assert [(await first.get(url)).text, (await second.get(url)).text] == ["ok"] * 2
            async with httpx.AsyncClient() as third:
                refused = [(await third.get(url)).status_code for _ in range(3)]
            assert (await first.get(url)).text == "ok"  # the open ones go on
        # Their connections closed: there is room again.
        async with httpx.AsyncClient() as later:
            assert (await later.get(url)).text == "ok"
    finally:
        await server.stop()
    assert refused == [503] * 3
    full = [record for record in caplog.records if "503" in record.getMessage()]
    assert len(full) == 1 and "http_max_connections" in full[0].getMessage()
