"""Large sent files: over the inline limit they stream as ordered FileChunk events before the
Result, which lists them as ``streamed`` with size and sha256; small ones stay inline."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.run_tools.blob import blob_bytes
from tests.runs_support import collect, execute_request, run_registry

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
