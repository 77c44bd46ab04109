"""Call trees through the HTTP gateway: runs carry parent_run_id, root_run_id and depth,
``GET /v1/runs`` filters by tree and by parent, a call hangs under a parent with
``parent_run_id`` in its body, and a hostile parent is refused as gRPC refuses it."""

from __future__ import annotations

from typing import Any

import httpx

from tests.tree_tools import tree_registry


async def test_the_http_api_lists_and_builds_call_trees(make_server: Any) -> None:
    server = await make_server(registry=tree_registry(), http_port=0)
    base_url = f"http://127.0.0.1:{server.http.gateway_port}"
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        reply = await http.post("/v1/tools/tree_node:execute?wait=true",
                                json={"arguments": {"levels": 1, "fan_out": 2}})
        assert reply.status_code == 200, reply.text
        root = reply.json()["run_id"]

        tree = (await http.get("/v1/runs", params={"root_run_id": root})).json()["runs"]
        assert len(tree) == 3
        by_depth = sorted((run["depth"], run["parent_run_id"], run["root_run_id"])
                          for run in tree)
        assert by_depth == [(0, "", root), (1, root, root), (1, root, root)]
        children = (await http.get("/v1/runs", params={"parent_run_id": root})).json()["runs"]
        assert len(children) == 2

        finished = await http.post("/v1/tools/echo:execute?wait=true",
                                   json={"arguments": {"text": "x"}, "parent_run_id": root})
        assert finished.status_code == 400, finished.text
        assert "PARENT_RUN_ENDED" in finished.text
        unknown = await http.post("/v1/tools/echo:execute?wait=true",
                                  json={"arguments": {"text": "x"}, "parent_run_id": "0" * 32})
        assert unknown.status_code == 404 and "RUN_NOT_FOUND" in unknown.text
        oversized = await http.get("/v1/runs", params={"root_run_id": "r" * 100})
        assert oversized.status_code == 400
        assert (await http.get("/v1/runs")).status_code == 200  # still serving
