"""Large sent files: over the inline limit they stream as ordered FileChunk events before the
Result, which lists them as ``streamed`` with size and sha256; small ones stay inline. And
large anything else: every Result and every event a tool can make huge fits the send limit,
so Execute and WatchRun always end with a Result."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, spec_of
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.run_tools.blob import blob_bytes
from tests.runs_support import collect, execute_request, key, run_registry

MiB = 1024 * 1024
BIG = 50 * MiB


def _peak_rss_reset() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM).
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def _receive(call) -> tuple[str, int, list[int], events_pb2.Result, str]:
    """Reads a stream, hashing file chunks as they come and keeping none of them."""
    run_id = ""
    digest = hashlib.sha256()
    size = 0
    offsets = []
    result = None
    while (response := await call.read()) is not grpc.aio.EOF:
        event = response.event
        run_id = event.run_id
        if event.HasField("file_chunk"):
            assert result is None, "a chunk after the Result"
            offsets.append(event.file_chunk.offset)
            assert event.file_chunk.offset == size
            digest.update(event.file_chunk.data)
            size += len(event.file_chunk.data)
        elif event.HasField("result"):
            result = event.result
    assert result is not None
    return digest.hexdigest(), size, offsets, result, run_id


@pytest.fixture
async def stub(make_server) -> tool_service_pb2_grpc.ToolServiceStub:
    server = await make_server(registry=run_registry())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield tool_service_pb2_grpc.ToolServiceStub(channel)
    await channel.close()


async def test_fifty_megabytes_arrive_intact_through_execute_and_watch_run(stub) -> None:
    expected = hashlib.sha256(blob_bytes(BIG, 7)).hexdigest()
    _peak_rss_reset()
    before = _peak_rss()

    digest, size, offsets, result, run_id = await _receive(
        stub.Execute(execute_request("blob", {"size": BIG, "seed": 7})))
    growth = _peak_rss() - before
    watched = await _receive(stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=run_id)))

    sent = result.writeback.sent_files[0]
    assert digest == expected and size == BIG
    assert sent.streamed and not sent.content
    assert sent.size == BIG and sent.sha256 == expected
    assert offsets == sorted(offsets) and len(offsets) == BIG // (256 * 1024)
    # The file exists once as the tool's bytes and once as chunks in the run log; a
    # copy per message or per subscriber would show up well above this.
    assert growth < 3 * BIG, f"peak memory grew by {growth / MiB:.0f} MiB"
    assert watched[:4] == (digest, size, offsets, result)


async def test_small_files_stay_inline(stub) -> None:
    events = await collect(stub.Execute(execute_request("blob", {"size": 1000, "seed": 1})))

    sent = events[-1].result.writeback.sent_files[0]
    assert not any(e.HasField("file_chunk") for e in events)
    assert sent.content == blob_bytes(1000, 1) and not sent.streamed


async def test_the_inline_limit_is_a_setting(make_server) -> None:
    server = await make_server(registry=run_registry(), inline_file_bytes=1000,
                               file_chunk_bytes=1024)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await collect(stub.Execute(execute_request("blob", {"size": 3000})))

    chunks = [e.file_chunk for e in events if e.HasField("file_chunk")]
    assert [(c.offset, len(c.data), c.last) for c in chunks] == [
        (0, 1024, False), (1024, 1024, False), (2048, 952, True)]
    assert b"".join(c.data for c in chunks) == blob_bytes(3000, 0)
    assert events[-1].HasField("result")
    assert events[-1].result.writeback.sent_files[0].streamed


# -- every Result and every event fits the send limit ---------------------------------------

HUGE = 70 * MiB


class Size(BaseModel):
    size: int = Field(ge=0)


@tool(kind="test")
async def huge_output(ctx: ToolContext, args: Size) -> str:
    """Returns ``size`` characters: "é" then digits."""
    return "é" + "0123456789" * (args.size // 10)


@tool(kind="test")
async def huge_delta(ctx: ToolContext, args: Size) -> str:
    """Streams one delta of ``size`` characters."""
    await ctx.delta("0123456789" * (args.size // 10), channel="stdout")
    return "streamed"


@tool(kind="test")
async def huge_structured(ctx: ToolContext, args: Size) -> dict[str, Any]:
    """Returns data whose JSON is about ``size`` bytes."""
    return {"rows": [{"n": i, "text": "x" * 90} for i in range(args.size // 100)]}


@tool(kind="test")
async def huge_writeback(ctx: ToolContext, args: Size) -> str:
    """Hands back inline-sized files, tools and rich messages of ``size`` bytes each, and
    makes every kind of event a tool controls that large."""
    text = "y" * args.size
    for index in range(8):
        ctx.send_file(f"part{index}.txt", text.encode(), "text/plain")
    for index in range(4):
        ctx.inject_tool(f"tool{index}", text, {"type": "object"})
        ctx.send_rich_message("card", {"index": index, "body": text})
    async with ctx.step(text, kind=text, detail={"blob": text}) as step:
        step.summary = text
        await step.delta("z", channel=text)
    await ctx.heartbeat(text)
    return "handed back"


class DeltasThenOutput(BaseModel):
    deltas: int = Field(ge=0)
    size: int = Field(ge=0)


@tool(kind="test")
async def deltas_then_output(ctx: ToolContext, args: DeltasThenOutput) -> str:
    """Streams ``deltas`` small deltas, waits a turn of the loop, then returns ``size``
    characters: every count of events before the Result's notice."""
    for index in range(args.deltas):
        await ctx.delta(f"{index}\n")
    await asyncio.sleep(0)
    return "0123456789" * (args.size // 10)


def _size_registry() -> Registry:
    specs = [spec_of(fn) for fn in (huge_output, huge_delta, huge_structured, huge_writeback,
                                    deltas_then_output)]
    return Registry([*run_registry().values(), *(spec for spec in specs if spec)])


async def _audit_details(server: StargrpcServer) -> list[tuple[str, str, str]]:
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await audit.writer.flush()
    return [(r.tool, r.outcome, r.detail) async for r in audit.writer.store.scan()]


def _files(events: list[events_pb2.RunEvent]) -> dict[str, bytes]:
    """The streamed files of a run, by name, reassembled from their chunks."""
    chunks: dict[str, bytearray] = {}
    for event in events:
        if event.HasField("file_chunk"):
            chunk = event.file_chunk
            data = chunks.setdefault(chunk.file_id, bytearray())
            assert chunk.offset == len(data)
            data += chunk.data
    result = events[-1].result
    return {f.name: bytes(chunks[f.file_id]) for f in result.writeback.sent_files
            if f.streamed}


async def _both_streams(make_server, tool_name: str, arguments: dict[str, Any],
                        **settings: Any
                        ) -> tuple[StargrpcServer, tuple[list[events_pb2.RunEvent], ...]]:
    """Runs a tool on a new server, reads it through Execute then WatchRun, and checks the
    server still serves; returns the server and both streams."""
    server = await make_server(registry=_size_registry(), **settings)
    # A client with gRPC's default receive limit (4 MiB): every event must fit it.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        executed = await collect(stub.Execute(execute_request(tool_name, arguments)))
        watched = await collect(stub.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=executed[0].run_id)))
        still = await collect(stub.Execute(execute_request("echo", {"text": "still here"})))
    assert still[-1].result.output == "still here"
    return server, (executed, watched)


async def test_seventy_megabytes_of_output_end_with_a_result_on_both_streams(make_server
                                                                             ) -> None:
    server, streams = await _both_streams(make_server, "huge_output", {"size": HUGE})

    whole = ("é" + "0123456789" * (HUGE // 10)).encode()
    for events in streams:
        result = events[-1].result
        assert result.outcome == events_pb2.OUTCOME_OK
        assert result.ByteSize() <= 4 * MiB - 1024  # max_event_bytes
        head, marker = result.output.split("\n[output truncated: ")
        assert whole.startswith(head.encode()) and len(head) > MiB
        assert f"{len(whole)} bytes in all" in marker and "output.txt" in marker
        notices = [e.notice for e in events if e.HasField("notice")]
        assert [n.code for n in notices] == ["OUTPUT_TRUNCATED"]
        assert events[-2].HasField("notice")  # said just before the Result
        assert _files(events)["output.txt"] == whole
        [listed] = result.writeback.sent_files
        assert listed.sha256 == hashlib.sha256(whole).hexdigest()
    tool_name, outcome, detail = (await _audit_details(server))[0]
    assert (tool_name, outcome) == ("huge_output", "ok")
    assert detail.startswith("OUTPUT_TRUNCATED: the output (")


async def test_a_seventy_megabyte_delta_arrives_whole_in_pieces(make_server) -> None:
    _, streams = await _both_streams(make_server, "huge_delta", {"size": HUGE})

    for events in streams:
        deltas = [e.step for e in events
                  if e.HasField("step") and e.step.phase == events_pb2.STEP_PHASE_DELTA]
        assert len(deltas) == HUGE // MiB
        assert all(len(d.delta) <= MiB and d.channel == "stdout" for d in deltas)
        assert "".join(d.delta for d in deltas) == "0123456789" * (HUGE // 10)
        assert events[-1].result.output == "streamed"


async def test_file_chunks_fit_a_send_limit_smaller_than_the_chunk_size(make_server) -> None:
    limit = 64 * 1024  # below the default file_chunk_bytes (256 KiB)
    server = await make_server(registry=run_registry(), max_send_message_bytes=limit,
                               inline_file_bytes=1000)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        digest, size, offsets, result, _ = await _receive(
            stub.Execute(execute_request("blob", {"size": 300 * 1024, "seed": 3})))

    assert result.outcome == events_pb2.OUTCOME_OK
    assert size == 300 * 1024 and digest == hashlib.sha256(blob_bytes(size, 3)).hexdigest()
    assert len(offsets) > 300 * 1024 // limit  # smaller chunks than configured, all sent


async def test_large_structured_output_moves_into_a_file(make_server) -> None:
    server, streams = await _both_streams(make_server, "huge_structured", {"size": 3 * MiB},
                                          max_send_message_bytes=MiB)

    for events in streams:
        result = events[-1].result
        assert result.outcome == events_pb2.OUTCOME_OK
        assert not result.HasField("structured_output")
        files = _files(events)
        rows = json.loads(files["structured_output.json"])["rows"]
        assert len(rows) == 3 * MiB // 100 and rows[-1]["n"] == len(rows) - 1
        assert json.loads(files["output.txt"]) == {"rows": rows}
        assert [e.notice.code for e in events if e.HasField("notice")] == [
            "OUTPUT_TRUNCATED", "OUTPUT_TRUNCATED"]
    _, outcome, detail = (await _audit_details(server))[0]
    assert outcome == "ok" and detail.count("OUTPUT_TRUNCATED") == 2


async def test_everything_else_a_tool_controls_is_bounded(make_server) -> None:
    limit = MiB
    # 8 inline-sized files of 200 KiB: 1.6 MiB together, over the limit of one message.
    server, streams = await _both_streams(make_server, "huge_writeback", {"size": 200 * 1024},
                                          max_send_message_bytes=limit, inline_file_bytes=limit)

    for events in streams:
        assert all(e.ByteSize() < limit for e in events)
        result = events[-1].result
        assert result.outcome == events_pb2.OUTCOME_OK and result.output == "handed back"
        sent = {f.name: f for f in result.writeback.sent_files}
        assert len(sent) == 8 and any(f.streamed for f in sent.values())
        assert sum(len(f.content) for f in sent.values()) <= limit // 4
        inline = {name: f.content for name, f in sent.items() if not f.streamed}
        assert {**inline, **_files(events)} == {f"part{i}.txt": b"y" * 200 * 1024
                                               for i in range(8)}
        # One injected tool and one rich message fit the quarter of the Result they share.
        assert len(result.writeback.injected_tools) + len(
            result.writeback.sent_rich_messages) < 8
        [notice] = [e.notice for e in events if e.HasField("notice")]
        assert notice.code == "RESULT_TOO_LARGE" and "injected tools" in notice.message
        step = next(e.step for e in events if e.HasField("step") and e.step.step.id == "s1")
        assert step.step.title.endswith("…") and len(step.step.title) <= 4096
        assert "omitted" in step.step.detail
        beat = next(e.heartbeat for e in events if e.HasField("heartbeat"))
        assert len(beat.message) <= 4096
    _, outcome, detail = (await _audit_details(server))[0]
    assert outcome == "ok" and detail.startswith("RESULT_TOO_LARGE: ")


async def test_a_call_replaying_a_cut_result_has_the_cut_in_its_record(make_server) -> None:
    # The second call holds the first's idempotency key: it replays that run rather than
    # running the tool. Its client gets the same cut Result and notice, and its audit
    # record says so too (it once did only for the call that started the run).
    server = await make_server(registry=_size_registry(), max_send_message_bytes=MiB)
    request = execute_request("huge_output", {"size": 2 * MiB}, idempotency_key=key())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        first = await collect(stub.Execute(request))
        again = await collect(stub.Execute(request))

    assert again[-1].run_id == first[-1].run_id
    for events in (first, again):
        assert [e.notice.code for e in events if e.HasField("notice")] == ["OUTPUT_TRUNCATED"]
    details = await _audit_details(server)
    assert len(details) == 2
    assert all(detail.startswith("OUTPUT_TRUNCATED: the output (") for _, _, detail in details)


async def test_the_cut_is_in_the_record_however_many_events_came_before_it(
        make_server) -> None:
    # The run gives the loop a turn every few events: wherever that turn falls, the notice
    # of the cut and the Result reach the call's record together.
    server = await make_server(registry=_size_registry(), max_send_message_bytes=MiB)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        for deltas in range(20):
            events = await collect(stub.Execute(execute_request(
                "deltas_then_output", {"deltas": deltas, "size": 2 * MiB})))
            assert [e.notice.code for e in events if e.HasField("notice")] == [
                "OUTPUT_TRUNCATED"]
    details = await _audit_details(server)
    assert len(details) == 20
    assert all(detail.startswith("OUTPUT_TRUNCATED: the output (") for _, _, detail in details)
