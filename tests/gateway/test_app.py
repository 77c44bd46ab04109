"""The HTTP gateway through a real server: JSON, Server-Sent Events, resumption, errors."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from stargrpc.gateway.app import STATIC_DIR
from tests.gateway.conftest import NUMBERS, GatewayUnderTest


async def read_sse(http: httpx.AsyncClient, method: str, url: str, *, limit: int = 1000,
                   **kwargs: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """Every (id, event, data) of an SSE response, until the server ends it."""
    seen = []
    async with aconnect_sse(http, method, url, **kwargs) as source:
        assert source.response.status_code == 200
        async for message in source.aiter_sse():
            seen.append((message.id, message.event, json.loads(message.data)))
            assert len(seen) <= limit
    return seen


def shape(events: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """A compact picture of an SSE stream, like tests.helpers.phases for gRPC."""
    shown = []
    for _, kind, data in events:
        if kind == "step":
            phase = data["step"]["phase"].removeprefix("STEP_PHASE_")
            item = f"{phase} {data['step']['step']['id']}"
            if phase == "DELTA":
                item += f" {data['step']['delta']!r}"
            shown.append(item)
        elif kind == "result":
            shown.append("RESULT " + data["result"]["outcome"].removeprefix("OUTCOME_"))
        else:
            shown.append(kind.upper())
    return shown


async def start(gw: GatewayUnderTest, tool: str, arguments: dict[str, Any]) -> str:
    reply = await gw.http.post(f"/v1/tools/{tool}:execute", json={"arguments": arguments})
    assert reply.status_code == 202, reply.text
    body = reply.json()
    assert reply.headers["location"] == body["events_url"] == f"/v1/runs/{body['run_id']}/events"
    return str(body["run_id"])


async def test_tools_lists_the_catalog_with_its_hash_as_etag(gateway) -> None:
    reply = await gateway.http.get("/v1/tools")

    assert reply.status_code == 200
    body = reply.json()
    names = [t["name"] for t in body["tools"]]
    assert {"echo", "count", "staged"} <= set(names)
    assert reply.headers["etag"] == f'"{body["catalog_hash"]}"'
    assert body["catalog_hash"] == gateway.server.runtime.registry.catalog_hash
    echo = next(t for t in body["tools"] if t["name"] == "echo")
    assert echo["input_schema"]["properties"]["text"]["type"] == "string"

    again = await gateway.http.get("/v1/tools", headers={"If-None-Match": reply.headers["etag"]})
    assert again.status_code == 304


async def test_execute_with_wait_answers_the_result(gateway) -> None:
    reply = await gateway.http.post("/v1/tools/echo:execute?wait=true",
                                    json={"arguments": {"text": "hi there"}})

    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["result"]["outcome"] == "OUTCOME_OK"
    assert body["result"]["output"] == "hi there"
    assert body["seq"] == "4"  # START, DELTA, END, then the Result
    assert body["events_url"] == f"/v1/runs/{body['run_id']}/events"


async def test_events_replay_a_run_as_sse_with_seq_ids(gateway) -> None:
    run_id = await start(gateway, "count", {"to": 3})

    events = await read_sse(gateway.http, "GET", f"/v1/runs/{run_id}/events")

    assert shape(events) == [
        "START s0", "START s1", "DELTA s1 '1\\n'", "DELTA s1 '2\\n'", "DELTA s1 '3\\n'",
        "END s1", "END s0", "RESULT OK"]
    assert [int(i) for i, _, _ in events] == list(range(1, 9))
    assert all(int(d["seq"]) == int(i) for i, _, d in events)
    assert {d["run_id"] for _, _, d in events} == {run_id}
    assert events[-1][2]["result"]["output"] == "counted to 3"


async def test_last_event_id_resumes_exactly_after_it(gateway) -> None:
    run_id = await start(gateway, "count", {"to": 3})
    everything = await read_sse(gateway.http, "GET", f"/v1/runs/{run_id}/events")

    resumed = await read_sse(gateway.http, "GET", f"/v1/runs/{run_id}/events",
                             headers={"Last-Event-ID": "3"})
    by_query = await read_sse(gateway.http, "GET", f"/v1/runs/{run_id}/events?after_seq=5")

    assert resumed == everything[3:]
    assert by_query == everything[5:]
    # Nothing after the Result: 204, which tells an EventSource to stop reconnecting.
    done = await gateway.http.get(f"/v1/runs/{run_id}/events",
                                  headers={"Last-Event-ID": everything[-1][0]})
    assert done.status_code == 204


async def test_a_watch_past_the_end_of_a_live_run_ends_cleanly_then_204(
        gateway, gate, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("stargrpc.gateway.app.FIRST_EVENT_WAIT_SECONDS", 0.05)
    name, opened = gate
    run_id = await start(gateway, "staged", {"gate": name})
    url = f"/v1/runs/{run_id}/events"

    async with aconnect_sse(gateway.http, "GET", url,
                            headers={"Last-Event-ID": "1000"}) as source:
        assert source.response.status_code == 200  # the run is still going: wait for more
        opened.set()
        kinds = [message.event async for message in source.aiter_sse()]
    done = await gateway.http.get(url, headers={"Last-Event-ID": "1000"})

    assert kinds == []  # the run ended before seq 1001: no error event, just the end
    assert done.status_code == 204


async def test_events_follow_a_live_run_until_its_result(gateway, gate) -> None:
    name, opened = gate
    run_id = await start(gateway, "staged", {"gate": name})
    seen: list[tuple[str, str, dict[str, Any]]] = []

    async with aconnect_sse(gateway.http, "GET", f"/v1/runs/{run_id}/events") as source:
        messages = source.aiter_sse()
        async for message in messages:
            seen.append((message.id, message.event, json.loads(message.data)))
            if shape(seen)[-1] == "DELTA s2 'considering…\\n'":
                break
        # The run is parked at the gate: what we have is all there is so far.
        assert "RESULT OK" not in shape(seen)
        opened.set()
        async for message in messages:
            seen.append((message.id, message.event, json.loads(message.data)))

    assert shape(seen)[-11:] == [
        "DELTA s2 'decided\\n'", "END s2", "START s3", "DELTA s3 'report written\\n'",
        "END s3", "END s0", "FILE_CHUNK", "FILE_CHUNK", "FILE_CHUNK", "FILE_CHUNK", "RESULT OK"]
    assert [int(i) for i, _, _ in seen] == list(range(1, len(seen) + 1))
    files = seen[-1][2]["result"]["writeback"]["sent_files"]
    assert [(f["name"], f["mime_type"], f["size"], f.get("streamed", False)) for f in files] == [
        ("report.txt", "text/plain", "11", False),
        ("numbers.csv", "text/csv", str(len(NUMBERS)), True)]
    chunks = [base64.b64decode(d["file_chunk"].get("data", "")) for _, k, d in seen
              if k == "file_chunk"]
    assert b"".join(chunks) == NUMBERS


async def test_execute_can_stream_its_own_events(gateway) -> None:
    events = await read_sse(gateway.http, "POST", "/v1/tools/count:execute",
                            json={"arguments": {"to": 2}},
                            headers={"Accept": "text/event-stream"})

    assert shape(events) == ["START s0", "START s1", "DELTA s1 '1\\n'", "DELTA s1 '2\\n'",
                             "END s1", "END s0", "RESULT OK"]
    assert [int(i) for i, _, _ in events] == list(range(1, 8))


async def test_a_dropped_http_stream_does_not_cancel_the_run(gateway, gate) -> None:
    name, opened = gate
    async with aconnect_sse(gateway.http, "POST", "/v1/tools/staged:execute",
                            json={"arguments": {"gate": name}},
                            headers={"Accept": "text/event-stream"}) as source:
        first = await anext(source.aiter_sse())
        run_id = json.loads(first.data)["run_id"]
    # The browser went away, and the gateway has seen it go; the run goes on regardless.
    gateway_app = gateway.server.http.gateway
    assert gateway_app is not None
    await asyncio.wait_for(gateway_app.streams_closed(), 30)
    assert run_id in gateway.server.runtime.runs
    opened.set()

    events = await read_sse(gateway.http, "GET", f"/v1/runs/{run_id}/events")

    assert shape(events)[-1] == "RESULT OK"
    assert events[-1][2]["result"]["output"] == "staged run done"


async def test_cancel_stops_a_run(gateway, gate) -> None:
    name, _ = gate
    run_id = await start(gateway, "staged", {"gate": name})

    reply = await gateway.http.post(f"/v1/runs/{run_id}:cancel", json={"reason": "enough"})
    events = await read_sse(gateway.http, "GET", f"/v1/runs/{run_id}/events")
    again = await gateway.http.post(f"/v1/runs/{run_id}:cancel")

    assert reply.status_code == 200 and reply.json() == {"cancelled": True}
    assert shape(events)[-1] == "RESULT CANCELLED"
    assert events[-1][2]["result"]["error"]["message"] == "enough"
    assert again.json() == {"cancelled": False}


async def test_steer_reaches_a_live_run_and_refuses_what_it_must(gateway, gate) -> None:
    name, opened = gate
    run_id = await start(gateway, "staged", {"gate": name})

    offered = await gateway.http.get("/v1/capabilities")
    reply = await gateway.http.post(f"/v1/runs/{run_id}:steer", json={"message": "go left"})
    empty = await gateway.http.post(f"/v1/runs/{run_id}:steer", json={})
    extra = await gateway.http.post(f"/v1/runs/{run_id}:steer",
                                    json={"message": "x", "who": "me"})
    unknown = await gateway.http.post("/v1/runs/doesnotexist:steer", json={"message": "x"})
    opened.set()
    events = await read_sse(gateway.http, "GET", f"/v1/runs/{run_id}/events")
    finished = await gateway.http.post(f"/v1/runs/{run_id}:steer", json={"message": "late"})

    assert offered.json()["steer"] is True
    assert reply.status_code == 200 and reply.json() == {"run_id": run_id}
    steered = [e[2]["notice"] for e in events if "notice" in e[2]]
    assert [(n["code"], n["message"]) for n in steered] == [("STEERED", "go left")]
    assert empty.status_code == 400 and extra.status_code == 400
    assert unknown.status_code == 404
    assert detail(unknown.json(), "ErrorInfo")["reason"] == "RUN_NOT_FOUND"
    assert finished.status_code == 400
    assert finished.json()["error"]["status"] == "FAILED_PRECONDITION"
    assert detail(finished.json(), "ErrorInfo")["reason"] == "RUN_FINISHED"


def detail(body: dict[str, Any], type_suffix: str) -> dict[str, Any]:
    return next(d for d in body["error"]["details"] if d["@type"].endswith(type_suffix))


async def test_refusals_are_http_errors_with_the_grpc_details(gateway) -> None:
    http = gateway.http

    unknown = await http.post("/v1/tools/nope:execute", json={})
    bad_args = await http.post("/v1/tools/count:execute", json={"arguments": {"to": "many"}})
    stale = await http.post("/v1/tools/echo:execute",
                            json={"arguments": {"text": "x"}, "catalog_hash": "old"})
    no_run = await http.get("/v1/runs/doesnotexist/events")
    no_run_cancel = await http.post("/v1/runs/doesnotexist:cancel")

    assert unknown.status_code == 404
    assert unknown.json()["error"]["status"] == "NOT_FOUND"
    assert detail(unknown.json(), "ErrorInfo")["reason"] == "TOOL_NOT_FOUND"
    assert bad_args.status_code == 400
    violations = detail(bad_args.json(), "BadRequest")["fieldViolations"]
    assert [v["field"] for v in violations] == ["arguments.to"]
    assert stale.status_code == 400
    assert stale.json()["error"]["status"] == "FAILED_PRECONDITION"
    assert detail(stale.json(), "ErrorInfo")["reason"] == "CATALOG_STALE"
    assert no_run.status_code == 404
    assert detail(no_run.json(), "ErrorInfo")["reason"] == "RUN_NOT_FOUND"
    assert no_run_cancel.status_code == 404


async def test_malformed_http_requests_get_clear_400s(gateway) -> None:
    http = gateway.http

    not_json = await http.post("/v1/tools/echo:execute", content=b"{oops",
                               headers={"Content-Type": "application/json"})
    flat_args = await http.post("/v1/tools/echo:execute", json={"text": "hi"})
    bad_context = await http.post("/v1/tools/echo:execute",
                                  json={"arguments": {"text": "x"}, "context": {"nope": 1}})
    bad_seq = await http.get("/v1/runs/x/events", headers={"Last-Event-ID": "-4"})
    too_big = await http.post("/v1/tools/echo:execute",
                              content=b" " * (gateway.server.settings.max_receive_message_bytes
                                              + 1),
                              headers={"Content-Type": "application/json"})

    for reply in (not_json, flat_args, bad_context, bad_seq):
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert 'go under "arguments"' in flat_args.json()["error"]["message"]
    assert detail(flat_args.json(), "BadRequest")["fieldViolations"][0]["field"] == "text"
    assert too_big.status_code == 413


#: A lone surrogate as JSON spells it: json.loads keeps it, a protobuf string cannot.
LONE = "\ud800"

#: (method, path, body, the field named in the 400) for each string of a JSON body that
#: becomes a protobuf string, and for arguments and a state value, which the server refuses.
LONE_SURROGATE_BODIES = [
    *(("POST", "/v1/tools/echo:execute", {"arguments": {"text": "x"}, field: LONE}, field)
      for field in ("idempotency_key", "catalog_hash", "parent_run_id", "session_id",
                    "lane")),
    ("POST", "/v1/tools/echo:execute", {"arguments": {"text": LONE}}, "arguments_json"),
    ("POST", "/v1/tools/echo:execute", {"arguments": {LONE: "x"}}, "arguments_json"),
    ("POST", "/v1/tools/echo:execute", {"arguments": {}, "context": {"end_user": LONE}},
     "context"),
    ("POST", "/v1/runs/r1:cancel", {"reason": LONE}, "reason"),
    ("POST", "/v1/runs/r1:steer", {"message": LONE}, "message"),
    ("POST", "/v1/runs/r1:approve", {"approval_id": LONE, "decision": "deny"}, "approval_id"),
    ("POST", "/v1/runs/r1:approve", {"approval_id": "a", "decision": "deny", "reason": LONE},
     "reason"),
    ("POST", "/v1/runs/r1:approve", {"approval_id": "a", "decision": "deny",
                                     "arguments_digest": LONE}, "arguments_digest"),
    ("POST", "/v1/sessions", {"kind": LONE}, "kind"),
    ("PUT", "/v1/state/global/k", {"value": {"note": [LONE]}}, "value_json"),
]


async def test_a_lone_surrogate_in_a_body_is_a_400_naming_its_field(gateway) -> None:
    http = gateway.http
    for method, path, body, field in LONE_SURROGATE_BODIES:
        # Sent as JSON spells it (json.dumps escapes it; it has no UTF-8 form to send).
        reply = await http.request(method, path, content=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"})

        assert reply.status_code == 400, (path, body, reply.text)
        error = reply.json()["error"]
        assert error["status"] == "INVALID_ARGUMENT"
        assert [v["field"] for v in detail(reply.json(), "BadRequest")["fieldViolations"]
                ] == [field], (path, body)
        if field not in ("arguments_json", "context", "value_json"):  # the gateway's own
            assert field in error["message"]
        still = await http.post("/v1/tools/echo:execute?wait=true",
                                json={"arguments": {"text": "still here"}})
        assert still.json()["result"]["output"] == "still here"


async def test_a_lone_surrogate_spelt_in_a_path_is_not_one(gateway) -> None:
    # A URL decodes percent escapes as UTF-8, an unpaired half as U+FFFD: the name or id
    # is one no tool, run, session or key has, never a string the request cannot hold.
    http = gateway.http
    tool = await http.post("/v1/tools/ech%ED%A0%80:execute", json={"arguments": {}})
    run = await http.post("/v1/runs/r%ED%A0%80:cancel")
    session = await http.post("/v1/sessions/s%ED%A0%80:close")
    key = await http.put("/v1/state/global/k%ED%A0%80", json={"value": 1})
    runs = await http.get("/v1/runs?lane=%ED%A0%80&tool=%ED%A0%80")

    assert (tool.status_code, run.status_code, session.status_code) == (404, 404, 404)
    assert detail(tool.json(), "ErrorInfo")["metadata"]["tool_name"] == "ech\ufffd\ufffd\ufffd"
    assert key.status_code == 400
    assert detail(key.json(), "BadRequest")["fieldViolations"][0]["field"] == "key"
    assert (runs.status_code, runs.json()["runs"]) == (200, [])


async def test_unknown_routes_and_methods_answer_json_errors(gateway) -> None:
    missing = await gateway.http.get("/v1/nothing-here")
    wrong_method = await gateway.http.get("/v1/tools/echo:execute")

    assert missing.status_code == 404
    assert missing.json()["error"]["status"] == "NOT_FOUND"
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"


async def test_idempotency_key_header_attaches_to_the_same_run(gateway, gate) -> None:
    name, opened = gate
    headers = {"Idempotency-Key": "gw-key-1"}
    first = await gateway.http.post("/v1/tools/staged:execute", headers=headers,
                                    json={"arguments": {"gate": name}})
    second = await gateway.http.post("/v1/tools/staged:execute", headers=headers,
                                     json={"arguments": {"gate": name}})
    opened.set()

    assert first.status_code == second.status_code == 202
    assert first.json()["run_id"] == second.json()["run_id"]


async def test_page_and_api_carry_security_headers(gateway) -> None:
    page = await gateway.http.get("/")
    script = await gateway.http.get("/static/progress.js")

    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert script.status_code == 200
    assert "EventSource" in script.text or "Last-Event-ID" in script.text


async def test_every_page_module_is_served_as_javascript(gateway) -> None:
    # The page is ES modules: a browser runs a module only when it comes with a JavaScript
    # MIME type (nosniff or not), one missing import stops the whole page, and after an
    # upgrade a fresh module must not run beside a stale one it imports.
    static = STATIC_DIR.resolve()
    page = await gateway.http.get("/")
    entry = re.search(r'<script type="module" src="/static/([^"]+)"', page.text)
    assert entry is not None

    seen: set[Path] = set()
    queue = [static / entry.group(1)]
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        reply = await gateway.http.get(f"/static/{path.relative_to(static).as_posix()}")
        assert reply.status_code == 200, path.name
        media_type = reply.headers["content-type"].split(";")[0]
        assert media_type in ("text/javascript", "application/javascript"), path.name
        assert reply.headers["x-content-type-options"] == "nosniff"
        # Revalidated on every load, as the page is: no fresh module beside a stale one.
        assert reply.headers["cache-control"] == "no-cache"
        again = await gateway.http.get(reply.url, headers={"If-None-Match": reply.headers["etag"]})
        assert again.status_code == 304 and again.headers["cache-control"] == "no-cache"
        for specifier in re.findall(r'^import [^;]*? from "([^"]+)";', reply.text, re.MULTILINE):
            queue.append((path.parent / specifier).resolve())

    assert seen == set(static.rglob("*.js")), "a module the page never imports"


async def test_stopping_the_server_ends_open_streams(make_server, gate) -> None:
    from tests.gateway.conftest import gateway_registry

    name, _ = gate
    server = await make_server(registry=gateway_registry(), http_port=0)
    base = f"http://127.0.0.1:{server.http.gateway_port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        run_id = (await http.post("/v1/tools/staged:execute",
                                  json={"arguments": {"gate": name}})).json()["run_id"]
        assert run_id in server.runtime.runs  # parked at the gate
        seen: list[tuple[str, str, dict[str, Any]]] = []
        async with aconnect_sse(http, "GET", f"/v1/runs/{run_id}/events") as source:
            messages = source.aiter_sse()
            async for message in messages:
                seen.append((message.id, message.event, json.loads(message.data)))
                if len(seen) == 1:  # the follower is connected: now stop the server
                    stopping = asyncio.create_task(server.stop(grace=0.1))
        await asyncio.wait_for(stopping, 30)

    # The drain cancelled the parked run; the follower saw its Result before the end.
    assert shape(seen)[0] == "START s0"
    assert shape(seen)[-1] == "RESULT CANCELLED"


async def test_a_malformed_request_without_credentials_is_refused_for_its_credentials(
        make_server, tmp_path) -> None:
    # Whoever may not call learns nothing of how a request would have been read: a bad
    # body, a bad query, an oversized body are a 401 without (or with wrong) credentials,
    # and the 400 / 413 that says what is wrong with them only to a caller who may call.
    # (The guard's own refusals, a wrong host, origin or content type, come first.)
    from stargrpc.auth.keys import KeyStore
    from tests.gateway.conftest import gateway_registry

    keys = KeyStore(tmp_path / "keys.json")
    admin = keys.create("web-admin", ["admin"])[1]
    server = await make_server(registry=gateway_registry(), http_port=0,
                               insecure_no_auth=False, keys_file=tmp_path / "keys.json",
                               max_receive_message_bytes=64 * 1024)
    base = f"http://127.0.0.1:{server.http.gateway_port}"
    malformed = [("POST", "/v1/tools/echo:execute", {"content": b"{not json"}),
                 ("POST", "/v1/tools/echo:execute", {"json": {"text": "arguments not"}}),
                 ("POST", "/v1/tools/echo:execute", {"content": b"x" * 100_000}),
                 ("GET", "/v1/runs?page_size=-3", {}),
                 ("GET", "/v1/runs/r1/events?after_seq=minus", {}),
                 ("POST", "/v1/runs/r1:steer", {"content": b"[]"}),
                 ("PUT", "/v1/state/global/k", {"content": b"{"}),
                 ("POST", "/v1/sessions", {"content": b"[" * 10_000 + b"]" * 10_000}),
                 ("GET", "/v1/runs/r1/events?after_seq=" + "9" * 40, {})]
    callers: dict[str, dict[str, Any]] = {
        "none": {}, "wrong": {"Authorization": "Bearer nope"},
        "unprintable": {"Authorization": "Bearer sgk_é☃\x01".encode()},
        "admin": {"Authorization": f"Bearer {admin}"}}
    seen: dict[str, list[int]] = {who: [] for who in callers}
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        for who, headers in callers.items():
            for method, path, body in malformed:
                reply = await http.request(
                    method, path, headers={**headers, "Content-Type": "application/json"},
                    **body)
                seen[who].append(reply.status_code)
                if who != "admin":
                    assert reply.headers["www-authenticate"].startswith("Bearer"), path
        unprintable = await http.get("/v1/tools", headers=callers["unprintable"])
        still = await http.get("/v1/tools", headers=callers["admin"])

    assert seen["none"] == seen["wrong"] == seen["unprintable"] == [401] * len(malformed)
    assert seen["admin"] == [400, 400, 413, 400, 400, 400, 400, 400, 400]
    assert unprintable.status_code == 401
    assert still.status_code == 200


async def test_the_servers_own_refusal_costs_no_credentials_check(make_server,
                                                                  tmp_path) -> None:
    # Only the gateway's own refusals (a body or query it cannot read) wait for the
    # credentials check: a refusal of the server's came after its own check.
    from stargrpc.audit.store import default_store_url, open_store
    from stargrpc.auth.keys import KeyStore
    from tests.gateway.conftest import gateway_registry

    keys = KeyStore(tmp_path / "keys.json")
    admin = keys.create("web-admin", ["admin"])[1]
    server = await make_server(registry=gateway_registry(), http_port=0,
                               insecure_no_auth=False, keys_file=tmp_path / "keys.json")
    as_admin = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http.gateway_port}",
                                 timeout=30) as http:
        by_server = await http.post("/v1/tools/echo:execute", headers=as_admin,
                                    json={"arguments": {"text": 5}})
        by_gateway = await http.post("/v1/tools/echo:execute", headers=as_admin,
                                     json={"text": "arguments not"})
    await server.stop(grace=5)
    store = open_store(default_store_url(server.settings.state_dir))
    await store.open()
    try:
        methods = [r.method.rsplit("/", 1)[-1] async for r in store.scan()]
    finally:
        await store.aclose()

    assert (by_server.status_code, by_gateway.status_code) == (400, 400)
    assert by_server.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert methods == ["Execute", "ListTools"]  # the one check: for the gateway's refusal


async def test_a_lone_surrogate_is_audited_as_other_bad_input_is(make_server) -> None:
    # In arguments the server refuses it (an Execute record, as for any bad argument); in
    # a field of the body the gateway does (no Execute, as for a body it cannot read).
    from stargrpc.audit.store import default_store_url, open_store
    from tests.gateway.conftest import gateway_registry

    server = await make_server(registry=gateway_registry(), http_port=0)
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http.gateway_port}",
                                 timeout=30) as http:
        in_arguments = await http.post("/v1/tools/echo:execute", headers=headers, content=(
            b'{"arguments": {"text": "\\ud800"}}'))
        in_key = await http.post("/v1/tools/echo:execute", headers=headers, content=(
            b'{"arguments": {"text": "x"}, "idempotency_key": "\\ud800"}'))
    await server.stop(grace=5)
    store = open_store(default_store_url(server.settings.state_dir))
    await store.open()
    try:
        records = [(r.method.rsplit("/", 1)[-1], r.outcome) async for r in store.scan()]
    finally:
        await store.aclose()

    assert (in_arguments.status_code, in_key.status_code) == (400, 400)
    assert [r for r in records if r[0] == "Execute"] == [("Execute", "invalid")]


async def test_gateway_authenticates_like_grpc(make_server, tmp_path) -> None:
    from stargrpc.audit.store import default_store_url, open_store
    from stargrpc.auth.keys import KeyStore
    from tests.gateway.conftest import gateway_registry

    keys = KeyStore(tmp_path / "keys.json")
    admin = keys.create("web-admin", ["admin"])[1]
    nobody = keys.create("web-nobody", ["no-such-role"])[1]
    server = await make_server(registry=gateway_registry(), http_port=0,
                               insecure_no_auth=False, keys_file=tmp_path / "keys.json",
                               tool_permissions={"echo": {"roles": ["admin"]}})
    base = f"http://127.0.0.1:{server.http.gateway_port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        anonymous = await http.get("/v1/tools")
        wrong = await http.get("/v1/tools", headers={"Authorization": "Bearer nope"})
        as_admin = {"Authorization": f"Bearer {admin}"}
        listed = await http.get("/v1/tools", headers=as_admin)
        ran = await http.post("/v1/tools/echo:execute?wait=true", headers=as_admin,
                              json={"arguments": {"text": "hi"}})
        denied = await http.post("/v1/tools/echo:execute",
                                 headers={"Authorization": f"Bearer {nobody}"},
                                 json={"arguments": {"text": "hi"}})
        events_url = ran.json()["events_url"]
        events_anonymous = await http.get(events_url)
        events = await read_sse(http, "GET", events_url, headers=as_admin)

    assert anonymous.status_code == wrong.status_code == 401
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    assert listed.status_code == 200
    assert ran.status_code == 200 and ran.json()["result"]["output"] == "hi"
    assert denied.status_code == 403
    assert denied.json()["error"]["status"] == "PERMISSION_DENIED"
    assert events_anonymous.status_code == 401
    assert shape(events)[-1] == "RESULT OK"

    # The same audit trail as gRPC calls: one record per call, with the key's principal.
    await server.stop(grace=5)
    store = open_store(default_store_url(server.settings.state_dir))
    await store.open()
    try:
        records = [r async for r in store.scan()]
    finally:
        await store.aclose()
    executes = [(r.principal, r.tool, r.outcome) for r in records
                if r.method.endswith("/Execute")]
    assert executes == [("web-admin", "echo", "ok"), ("web-nobody", "echo", "denied")]
    watches = [(r.principal, r.outcome) for r in records if r.method.endswith("/WatchRun")]
    assert watches == [("", "unauthenticated"), ("web-admin", "ok")]


@pytest.mark.parametrize("ca", ["the server's CA", "a stale path"])
async def test_gateway_reaches_a_server_that_serves_tls(make_server, tmp_path, ca) -> None:
    # It calls its server in-process: the CA it would have trusted over the network is
    # not read, so a stale path there does not stop the server serving HTTP either.
    from tests.auth.certs import TestCA
    from tests.gateway.conftest import gateway_registry

    files = TestCA().server_files(tmp_path)
    ca_file = files.pop("tls_client_ca_file")  # TLS without client certificates
    if ca == "a stale path":
        ca_file = tmp_path / "gone.pem"
    server = await make_server(registry=gateway_registry(), http_port=0, insecure_no_auth=True,
                               http_grpc_ca_file=ca_file, **files)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http.gateway_port}",
                                 timeout=30) as http:
        reply = await http.post("/v1/tools/echo:execute?wait=true",
                                json={"arguments": {"text": "over TLS"}})

    assert reply.status_code == 200, reply.text
    assert reply.json()["result"]["output"] == "over TLS"


def test_gateway_refuses_to_front_client_certificate_auth(tmp_path) -> None:
    from pydantic import ValidationError

    from stargrpc.settings import Settings

    with pytest.raises(ValidationError, match="client certificates"):
        Settings(http_port=8080, tls_cert_file=tmp_path / "c", tls_key_file=tmp_path / "k",
                 tls_client_ca_file=tmp_path / "ca")


async def test_execute_takes_lane_priority_and_max_wait(gateway) -> None:
    http = gateway.http

    ok = await http.post("/v1/tools/echo:execute?wait=true", json={
        "arguments": {"text": "x"}, "priority": 3, "max_wait_seconds": 5})
    negative = await http.post("/v1/tools/echo:execute", json={
        "arguments": {"text": "x"}, "priority": -1})
    huge = await http.post("/v1/tools/echo:execute", json={
        "arguments": {"text": "x"}, "priority": 2**40})
    unknown = await http.post("/v1/tools/echo:execute", json={
        "arguments": {"text": "x"}, "lane": "nope"})

    assert ok.status_code == 200, ok.text
    assert ok.json()["result"]["outcome"] == "OUTCOME_OK"
    assert negative.status_code == 400
    assert [v["field"] for v in detail(negative.json(), "BadRequest")["fieldViolations"]] == [
        "priority"]
    assert huge.status_code == 400
    assert unknown.status_code == 400
    assert detail(unknown.json(), "ErrorInfo")["reason"] == "LANE_UNKNOWN"


async def test_a_refused_caller_cannot_make_the_gateway_hold_a_large_body(make_server,
                                                                         tmp_path) -> None:
    # The body was read whole (up to max_body_bytes) before the server saw the credentials:
    # anyone could make the gateway hold 8 MiB per connection. Past the first 64 KiB the
    # credentials are asked for, and a refused caller gets its 401 without the rest read.
    from stargrpc.auth.keys import KeyStore
    from tests.gateway.conftest import gateway_registry

    keys = KeyStore(tmp_path / "keys.json")
    admin = keys.create("web-admin", ["admin"])[1]
    server = await make_server(registry=gateway_registry(), http_port=0,
                               insecure_no_auth=False, keys_file=tmp_path / "keys.json")
    port = server.http.gateway_port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/tools/echo:execute HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Authorization: Bearer nope\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4000000\r\n\r\n" + b'{"arguments": {"text": "'
                     + b"x" * 1_000_000)  # a quarter of the body; the rest never comes
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 401 ")

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        large = await http.post("/v1/tools/echo:execute?wait=true", headers={
            "Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
            content=b'{"arguments": {"text": "' + b"y" * 90_000 + b'"}}' + b" " * 300_000)
    assert large.status_code == 200
    assert large.json()["result"]["output"] == "y" * 90_000


@pytest.mark.parametrize(("bound", "value"), [("MAX_QUEUED_EVENT_BYTES", 64 * 1024),
                                              ("MAX_QUEUED_EVENTS", 200)])
async def test_a_stream_that_is_not_read_ends_rather_than_queue_the_run(
        gateway, monkeypatch, bound: str, value: int) -> None:
    # POST …:execute with Accept: text/event-stream queued every event of the run for a
    # client that did not read them: a run streaming 100000 deltas to a client that never
    # read made the gateway hold some 100 MB. Past a bound the stream ends, and the client
    # follows the run again with Last-Event-ID.
    import socket

    from stargrpc.gateway import client as gateway_client

    monkeypatch.setattr(gateway_client, bound, value)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client reads nothing
    sock.connect(("127.0.0.1", gateway.server.http.gateway_port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    body = b'{"arguments": {"to": 30000}}'
    writer.write(b"POST /v1/tools/count:execute HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Accept: text/event-stream\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        seen = await asyncio.wait_for(reader.readuntil(b'"run_id":"'), 10)
        run_id = (await reader.readexactly(32)).decode()
        # The run goes to its end while the first client reads nothing.
        async with gateway.http.stream("GET", f"/v1/runs/{run_id}/events") as followed:
            assert followed.status_code == 200
            async for line in followed.aiter_lines():
                if line == "event: result":
                    break
        seen += await asyncio.wait_for(reader.read(), 30)  # now all that was sent to it
    finally:
        writer.close()

    assert seen.endswith(b"0\r\n\r\n")  # the stream ended, in good order ...
    assert b"event: result" not in seen  # ... before the Result
    last_id = re.findall(rb"\nid: (\d+)\n", seen)[-1].decode()
    async with gateway.http.stream("GET", f"/v1/runs/{run_id}/events",
                                   headers={"Last-Event-ID": last_id}) as rest:
        lines = [line async for line in rest.aiter_lines()]
    assert lines[0] == f"id: {int(last_id) + 1}"
    assert "event: result" in lines


async def test_one_caller_holds_a_bounded_number_of_event_streams(gateway, gate,
                                                                  monkeypatch) -> None:
    # Each live run list polled the server every second for as long as it was open, each
    # run's stream held a WatchRun: one caller could open them without end. Past the
    # bound it gets 429 (a run it started still goes on); a closed stream frees its place.
    from stargrpc.gateway import app as gateway_app

    monkeypatch.setattr(gateway_app, "MAX_STREAMS_PER_CALLER", 2)
    name, _ = gate
    as_one = {"Authorization": "Bearer one"}  # no authentication: the credentials name it
    async with contextlib.AsyncExitStack() as streams:
        for query in ("?tool=a", "?tool=b"):
            opened = await streams.enter_async_context(
                gateway.http.stream("GET", "/v1/runs/events" + query, headers=as_one))
            assert opened.status_code == 200
        # The same token however the header spells it: the server reads it so.
        third = await gateway.http.get("/v1/runs/events?tool=c",
                                       headers={"Authorization": "bEARER   one"})
        started = await gateway.http.post(
            "/v1/tools/staged:execute", json={"arguments": {"gate": name}},
            headers={**as_one, "Accept": "text/event-stream"})
        other = await streams.enter_async_context(
            gateway.http.stream("GET", "/v1/runs/events", headers={
                "Authorization": "Bearer two"}))
        assert other.status_code == 200  # another caller's streams are its own
        assert (third.status_code, started.status_code) == (429, 429)
        assert third.json()["error"]["status"] == "RESOURCE_EXHAUSTED"
        run_id = started.json()["error"]["message"].split("the run ")[1].split()[0]
        listed = await gateway.http.get("/v1/runs", headers=as_one)
        assert run_id in [run["run_id"] for run in listed.json()["runs"]]
    served = gateway.server.http.gateway
    assert served is not None
    await asyncio.wait_for(served.streams_closed(), 10)  # the server saw them go
    for _ in range(200):  # ... and has given their places back
        if not served._streams_by_caller:
            break
        await asyncio.sleep(0.01)
    async with gateway.http.stream("GET", "/v1/runs/events?tool=c", headers=as_one) as again:
        assert again.status_code == 200


async def test_api_answers_are_kept_by_no_cache(gateway) -> None:
    # The API's answers (a caller's runs, sessions, state, its refusals) named no caching
    # rule: a browser could keep them on disk. The catalog is kept privately and asked
    # again each time (its ETag makes that a 304).
    answers = [await gateway.http.get(path) for path in
               ("/v1/runs", "/v1/sessions", "/v1/capabilities", "/v1/runs/nope/events",
                "/v1/state/nope")]
    answers.append(await gateway.http.post("/v1/tools/echo:execute?wait=true",
                                           json={"arguments": {"text": "hi"}}))
    assert [a.headers.get("cache-control") for a in answers] == ["no-store"] * len(answers)
    tools = await gateway.http.get("/v1/tools")
    assert tools.headers["cache-control"] == "private, no-cache"
    again = await gateway.http.get("/v1/tools", headers={"If-None-Match": tools.headers["etag"]})
    assert again.status_code == 304
    page = await gateway.http.get("/")
    assert page.headers["cache-control"] == "no-cache"  # the page's own rule stands
