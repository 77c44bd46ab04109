"""Sessions through every face: the Python client, the CLI and the HTTP API."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import grpc
import httpx
import pytest

from stargrpc.client import AsyncClient, CallError, Client

TIMEOUT = 60


@pytest.fixture
async def server(make_server):
    return await make_server(http_port=0, sandbox_max_processes=32)


async def test_the_async_client_opens_uses_lists_and_closes_a_session(server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        client = AsyncClient(channel)
        session = await client.create_session("python", idle_seconds=60)
        await client.call("python", {"code": "import math\nr = 2"}, session_id=session.session_id)
        result = await client.call("python", {"code": "round(math.pi * r ** 2, 2)"},
                                   session_id=session.session_id)
        assert result.structured_output == 12.57
        [listed] = await client.list_sessions()
        assert (listed.session_id, listed.calls) == (session.session_id, 2)
        await client.close_session(session.session_id)
        assert await client.list_sessions() == []
        with pytest.raises(CallError) as caught:
            await client.close_session(session.session_id)
        assert caught.value.reason == "SESSION_NOT_FOUND"


async def test_the_sync_client_runs_calls_in_a_session(server) -> None:
    def use() -> object:
        with Client(f"127.0.0.1:{server.port}") as client:
            session = client.create_session()
            client.call("python", {"code": "seen = []"}, session_id=session.session_id)
            for word in ("a", "b"):
                client.call("python", {"code": f"seen.append({word!r})"},
                            session_id=session.session_id)
            result = client.call("python", {"code": "seen"}, session_id=session.session_id)
            client.close_session(session.session_id)
            return result.structured_output

    assert await asyncio.to_thread(use) == ["a", "b"]


async def _stargrpc(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_cli_creates_calls_in_lists_and_closes_a_session(server) -> None:
    target = ("--target", f"127.0.0.1:{server.port}")
    code, out, err = await _stargrpc("session", "create", *target, "python")
    assert code == 0, err
    session_id = out.strip()
    assert session_id.startswith("ses_")
    code, out, err = await _stargrpc("call", *target, "python", "--session", session_id,
                                     "--args", json.dumps({"code": "x = 20"}))
    assert code == 0, err
    code, out, err = await _stargrpc("call", *target, "python", "--session", session_id,
                                     "--args", json.dumps({"code": "print(x + 1)"}), "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["result"]["output"] == "21"
    code, out, _ = await _stargrpc("session", "list", *target)
    assert session_id in out and "2 calls" in out
    code, out, _ = await _stargrpc("session", "list", *target, "--json")
    assert [s["session_id"] for s in json.loads(out)] == [session_id]
    code, _, err = await _stargrpc("session", "close", *target, session_id)
    assert code == 0 and "closed" in err
    code, _, err = await _stargrpc("session", "close", *target, session_id)
    assert code == 1 and "session" in err
    code, _, err = await _stargrpc("call", *target, "python", "--session", session_id,
                                   "--args", json.dumps({"code": "x"}))
    assert code == 1 and "unknown session" in err


async def test_the_http_api_creates_executes_in_lists_and_closes_sessions(server) -> None:
    base = f"http://127.0.0.1:{server.http.gateway_port}"
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as http:
        made = await http.post("/v1/sessions", json={"kind": "python"})
        assert made.status_code == 200, made.text
        session_id = made.json()["session_id"]
        for code in ("total = 40", "total + 2"):
            ran = await http.post("/v1/tools/python:execute?wait=true",
                                  json={"arguments": {"code": code}, "session_id": session_id})
            assert ran.status_code == 200, ran.text
        assert ran.json()["result"]["structured_output"] == 42
        listed = (await http.get("/v1/sessions")).json()["sessions"]
        assert [(s["session_id"], int(s["calls"])) for s in listed] == [(session_id, 2)]
        closed = await http.post(f"/v1/sessions/{session_id}:close")
        assert closed.json() == {"session_id": session_id}
        # Hostile and broken requests get precise answers, and the gateway serves on.
        again = await http.post(f"/v1/sessions/{session_id}:close")
        assert again.status_code == 404
        gone = await http.post("/v1/tools/python:execute?wait=true",
                               json={"arguments": {"code": "1"}, "session_id": session_id})
        assert gone.status_code == 404
        for body in ({"kind": "cobol"}, {"kind": "python", "memory_mb": -1},
                     {"kind": "python", "surprise": 1}, {"kind": "python", "ttl_seconds": 2**40}):
            refused = await http.post("/v1/sessions", json=body)
            assert refused.status_code == 400, body
        broken = await http.post("/v1/sessions", content=b"{not json",
                                 headers={"content-type": "application/json"})
        assert broken.status_code == 400
        assert (await http.get("/v1/sessions")).json() == {"sessions": []}
