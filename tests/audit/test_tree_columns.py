"""The audit columns of call trees (``parent_run_id``, ``root_run_id``) in both stores: kept,
hashed, queried by tree (``Query(root_run_id=…)``: the root's record and those of every run
below it), and added to a table made before them, whose older rows still verify."""

from __future__ import annotations

from stargrpc.audit.chain import verify
from stargrpc.audit.sql import TABLE
from stargrpc.audit.store import AuditStore, Query, open_store
from tests.audit.helpers import execute_raw
from tests.audit.records import make_record


async def test_tree_columns_are_kept_hashed_and_queried(store: AuditStore) -> None:
    await store.append([
        make_record(run_id="root", root_run_id="root"),
        make_record(run_id="child", parent_run_id="root", root_run_id="root"),
        make_record(run_id="", parent_run_id="child", root_run_id="root",
                    outcome="invalid", detail="RUN_DEPTH_EXCEEDED: too deep"),
        make_record(run_id="other", root_run_id="other"),
        make_record(run_id="root", method="/stargrpc.v1.ToolService/WatchRun"),
    ])
    tree = await store.query(Query(root_run_id="root"))
    assert [r.seq for r in tree] == [1, 2, 3, 5]  # a WatchRun of the root is the root's too
    assert tree[1].parent_run_id == "root" and tree[1].root_run_id == "root"
    assert (await verify(store.scan())).intact
    stored = [r async for r in store.scan()]
    assert stored[2].parent_run_id == "child"


async def test_a_table_made_before_trees_gains_the_columns(store_url: str) -> None:
    first = open_store(store_url)
    await first.open()
    await first.append([make_record(run_id="old")])
    await first.aclose()
    await execute_raw(store_url, f"ALTER TABLE {TABLE} DROP COLUMN parent_run_id",
                      f"ALTER TABLE {TABLE} DROP COLUMN root_run_id")
    again = open_store(store_url)
    await again.open()
    try:
        await again.append([make_record(run_id="new", root_run_id="new")])
        assert (await verify(again.scan())).intact
        assert [r.seq for r in await again.query(Query(root_run_id="new"))] == [2]
    finally:
        await again.aclose()
