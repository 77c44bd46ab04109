"""knowledge_search through a real server."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, phases, run_tool
from tests.kb.corpus import write_corpus


@pytest.fixture
async def docs_and_stub(make_server, tmp_path):
    docs = write_corpus(tmp_path / "docs")
    server = await make_server(kb_dir=docs)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield docs, tool_service_pb2_grpc.ToolServiceStub(channel)


async def test_ranks_the_relevant_document_first_with_snippets(docs_and_stub) -> None:
    _, stub = docs_and_stub
    events = await run_tool(stub, "knowledge_search", {"query": "restore a backup", "limit": 2})

    assert phases(events) == [
        "START s0", "START s1",
        "DELTA s1 '4 documents indexed: 4 added, 0 updated, 0 removed, 0 unchanged\\n'",
        "END s1 COMPLETE", "START s2",
        "DELTA s2 '1. ops/backups.md > Backups > Restoring a backup\\n'",
        "DELTA s2 '2. ops/backups.md > Backups\\n'",
        "END s2 COMPLETE", "END s0 COMPLETE", "RESULT OK"]
    structured = as_dict(events[-1].result)["structured_output"]
    first = structured["passages"][0]
    assert (first["rank"], first["path"]) == (1, "ops/backups.md")
    assert "**restore**" in first["snippet"].lower()


async def test_an_edited_file_is_found_on_the_next_call(docs_and_stub) -> None:
    docs, stub = docs_and_stub
    await run_tool(stub, "knowledge_search", {"query": "soup"})
    (docs / "team/lunch.txt").write_text("Lunch moved: tacos every Thursday.\n")

    events = await run_tool(stub, "knowledge_search", {"query": "tacos"})

    assert "1 updated" in events[2].step.delta
    passages = as_dict(events[-1].result)["structured_output"]["passages"]
    assert [p["path"] for p in passages] == ["team/lunch.txt"]


async def test_without_a_configured_folder_it_fails_clearly(make_server) -> None:
    server = await make_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "knowledge_search", {"query": "x"})

    assert events[-1].result.outcome == events_pb2.OUTCOME_FAILED
    assert events[-1].result.error.message == "no knowledge base is configured (set kb_dir)"


async def test_a_link_out_of_the_folder_is_not_searched(docs_and_stub, tmp_path) -> None:
    docs, stub = docs_and_stub
    secret = tmp_path / "elsewhere" / "secret.md"
    secret.parent.mkdir()
    secret.write_text("# Secret\n\nThe zebra launch codes.\n")
    (docs / "leak.md").symlink_to(secret)
    (docs / "team" / "up.md").symlink_to("../../elsewhere/secret.md")
    (docs / "linked").symlink_to(secret.parent)

    events = await run_tool(stub, "knowledge_search", {"query": "zebra launch codes"})

    assert events[2].step.delta == ("4 documents indexed: 4 added, 0 updated, 0 removed, "
                                    "0 unchanged\n")
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert as_dict(events[-1].result)["structured_output"]["passages"] == []
    again = await run_tool(stub, "knowledge_search", {"query": "restore a backup"})
    assert as_dict(again[-1].result)["structured_output"]["passages"][0]["path"] == (
        "ops/backups.md")


async def test_a_file_whose_name_is_not_utf8_is_indexed_with_its_bytes_spelt_out(
        docs_and_stub) -> None:
    # SQLite refused the name (a lone surrogate) and the refresh with it: one such file
    # made every search fail.
    docs, stub = docs_and_stub
    (docs / os.fsdecode(b"caf\xe9.md")).write_text("# Menu\n\nThe quince tart.\n")

    events = await run_tool(stub, "knowledge_search", {"query": "quince"})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result.error
    passages = as_dict(events[-1].result)["structured_output"]["passages"]
    assert [p["path"] for p in passages] == ["caf\\xe9.md"]
    # The other documents are searched as before.
    events = await run_tool(stub, "knowledge_search", {"query": "restore a backup"})
    assert as_dict(events[-1].result)["structured_output"]["passages"][0]["path"] == \
        "ops/backups.md"


async def test_a_folder_nested_a_thousand_deep_is_searched(docs_and_stub) -> None:
    # The walk recursed once a level: on Python 3.11 it raised RecursionError, and every
    # search failed with it.
    docs, stub = docs_and_stub
    levels = [docs]
    for _ in range(1100):  # one level at a time: pathlib's mkdir(parents=True) recurses
        levels.append(levels[-1] / "d")
        levels[-1].mkdir()
    (levels[-1] / "bottom.md").write_text("# Bottom\n\nThe anglerfish lives here.\n")
    try:
        events = await run_tool(stub, "knowledge_search", {"query": "anglerfish"})

        assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result.error
        [passage] = as_dict(events[-1].result)["structured_output"]["passages"]
        assert passage["path"] == "d/" * 1100 + "bottom.md"
    finally:
        # Removed here, bottom up: pytest's clean-up of old temporary folders (shutil's
        # rmtree) recurses too, and would fail on it in a later session.
        (levels[-1] / "bottom.md").unlink()
        for level in reversed(levels[1:]):
            level.rmdir()


async def test_a_search_needs_none_of_the_threads_the_server_shares(docs_and_stub) -> None:
    """The index's work (and its waits for the index's lock while another call refreshes
    it) runs in threads of its own: with every thread of asyncio's default executor taken
    (by sandbox set-ups, say), a search still answers."""
    _, stub = docs_and_stub
    loop = asyncio.get_running_loop()
    shared = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(shared)
    held = threading.Event()
    taken = loop.run_in_executor(None, held.wait, 30)
    try:
        async with asyncio.timeout(20):
            events = await run_tool(stub, "knowledge_search", {"query": "restore a backup"})
    finally:
        held.set()
        await taken
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
