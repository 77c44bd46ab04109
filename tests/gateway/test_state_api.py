"""The gateway's run state routes (gateway/state_api.py) on a real server with
authentication on: an admin reads, writes, lists and deletes over HTTP with the same checks
as over gRPC; anyone else gets 403; bad input gets 400 naming the field."""

from __future__ import annotations

from typing import Any

import httpx

SETTINGS = {"http_port": 0, "state_max_value_bytes": 128}


async def _gateway(make_auth_server: Any) -> tuple[Any, httpx.AsyncClient, httpx.AsyncClient]:
    auth = await make_auth_server(roles=("admin",), **SETTINGS)
    base = f"http://127.0.0.1:{auth.server.http.gateway_port}"
    admin = httpx.AsyncClient(base_url=base, timeout=30,
                              headers={"Authorization": f"Bearer {auth.key}"})
    viewer = httpx.AsyncClient(base_url=base, timeout=30, headers={
        "Authorization": f"Bearer {auth.add_key('viewer', 'tools')}"})
    return auth, admin, viewer


async def test_an_admin_reads_and_writes_state_over_http(make_auth_server) -> None:
    _, admin, _ = await _gateway(make_auth_server)
    async with admin:
        put = await admin.put("/v1/state/tree/plan?run_id=r1",
                              json={"value": {"steps": [1, 2], "big": 2**62}})
        assert (put.status_code, put.json()) == (200, {})
        await admin.put("/v1/state/tree/note?run_id=r1", json={"value": "x", "ttl_seconds": 60})
        got = await admin.get("/v1/state/tree/plan?run_id=r1")
        assert got.json() == {"found": True, "value": {"steps": [1, 2], "big": 2**62}}
        assert (await admin.get("/v1/state/run/plan?run_id=r1")).json() == {"found": False}
        listed = await admin.get("/v1/state/tree?run_id=r1&with_values=true&page_size=1")
        assert listed.json() == {"entries": [{"key": "note", "value": "x"}],
                                 "next_after_key": "note"}
        rest = await admin.get("/v1/state/tree?run_id=r1&after_key=note")
        assert rest.json() == {"entries": [{"key": "plan"}], "next_after_key": ""}
        deleted = await admin.delete("/v1/state/tree/plan?run_id=r1")
        assert deleted.json() == {"deleted": True}
        assert (await admin.delete("/v1/state/tree/plan?run_id=r1")).json() == {
            "deleted": False}


async def test_refusals_over_http(make_auth_server) -> None:
    _, admin, viewer = await _gateway(make_auth_server)
    async with admin, viewer:
        denied = await viewer.get("/v1/state/global/k")
        assert denied.status_code == 403
        assert denied.json()["error"]["status"] == "PERMISSION_DENIED"
        async with httpx.AsyncClient(base_url=str(admin.base_url)) as nobody:
            assert (await nobody.get("/v1/state/global")).status_code == 401

        def field_of(response: httpx.Response) -> tuple[int, str]:
            details = response.json()["error"]["details"]
            [bad] = [d for d in details if d["@type"].endswith("BadRequest")]
            return response.status_code, bad["fieldViolations"][0]["field"]

        assert field_of(await admin.get("/v1/state/galaxy/k")) == (400, "scope")
        assert field_of(await admin.get("/v1/state/run/k")) == (400, "scope.run_id")
        assert field_of(await admin.get("/v1/state/global/a:b")) == (400, "key")
        assert field_of(await admin.put("/v1/state/global/k", json={"value": "x" * 200})) \
            == (400, "value_json")
        assert field_of(await admin.put("/v1/state/global/k", json={"valu": 1})) \
            == (400, "value")
        assert field_of(await admin.put("/v1/state/global/k", content=b'{"value": NaN}',
                                        headers={"content-type": "application/json"})) \
            == (400, "value")
        assert field_of(await admin.put("/v1/state/global/k",
                                        json={"value": 1, "ttl_seconds": -5})) \
            == (400, "ttl_seconds")
        assert field_of(await admin.get("/v1/state/global?page_size=lots")) \
            == (400, "page_size")
        not_json = await admin.put("/v1/state/global/k", content=b"{",
                                   headers={"content-type": "application/json"})
        assert not_json.status_code == 400
        # The server serves on after each.
        assert (await admin.put("/v1/state/global/k", json={"value": 1})).status_code == 200
        assert (await admin.get("/v1/state/global/k")).json() == {"found": True, "value": 1}
