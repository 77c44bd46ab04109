"""``stargrpc serve --http-port`` and ``STARGRPC_METRICS_PORT`` in a real server process:
the gateway, the page and the metrics answer on the ports the log names, and SIGTERM still
stops the process cleanly."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

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
