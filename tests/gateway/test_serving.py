"""``stargrpc serve --http-port`` and ``STARGRPC_METRICS_PORT`` in a real server process:
the gateway, the page and the metrics answer on the ports the log names, and SIGTERM still
stops the process cleanly."""

from __future__ import annotations

from pathlib import Path

import httpx

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
