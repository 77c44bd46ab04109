"""Webhook delivery through a real server to the example receiver (HTTPS on loopback):
the signature it verifies, retries after it fails twice, and targets refused before the run
starts."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import ssl
import threading
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2

import stargrpc.v1
from stargrpc import metrics
from stargrpc.delivery import sign, verify
from stargrpc.delivery.audit import DELIVERY_METHOD
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.delivery.helpers import KEY, make_delivering_server, receiver_module, with_webhook
from tests.helpers import eventually, status_details
from tests.runs_support import collect


def start_receiver(tls: dict[str, Path], *, fail_first: int = 0) -> Iterator:
    receiver = receiver_module.serve(0, KEY, tls["tls_cert_file"], tls["tls_key_file"],
                                     fail_first=fail_first)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.shutdown()
        receiver.server_close()
        thread.join(5)


@pytest.fixture
def receiver(tls):
    yield from start_receiver(tls)


@pytest.fixture
def flaky_receiver(tls):
    yield from start_receiver(tls, fail_first=2)


async def wait_for(receiver, run_id: str) -> dict:
    async with asyncio.timeout(30):
        while run_id not in receiver.deliveries:
            await asyncio.to_thread(receiver.received.wait, 1.0)
            receiver.received.clear()
    return receiver.deliveries[run_id]


async def test_the_result_arrives_signed_and_the_example_receiver_verifies_it(
        make_server, tmp_path, tls, receiver) -> None:
    channel, stub = await make_delivering_server(make_server, tmp_path, tls)
    url = f"https://127.0.0.1:{receiver.server_address[1]}/hook"
    delivered = metrics.DELIVERIES.labels("webhook", "delivered")
    before = delivered._value.get()
    async with channel:
        started = await stub.StartRun(with_webhook(url))
        delivery = await wait_for(receiver, started.run_id)
        events = await collect(stub.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=started.run_id)))

    assert delivery["run_id"] == started.run_id and delivery["tool_name"] == "echo"
    assert delivery["result"]["outcome"] == "OUTCOME_OK"
    assert delivery["result"]["output"] == events[-1].result.output
    assert receiver.refused == 0
    assert delivered._value.get() == before + 1


async def test_a_delivery_is_retried_after_the_receiver_fails_twice(
        make_server, tmp_path, tls, flaky_receiver) -> None:
    channel, stub = await make_delivering_server(make_server, tmp_path, tls)
    url = f"https://127.0.0.1:{flaky_receiver.server_address[1]}/hook"
    failed = metrics.DELIVERY_ATTEMPTS.labels("webhook", "failed")
    before = failed._value.get()
    async with channel:
        executed = await collect(stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="echo", arguments_json='{"text": "x"}',
            delivery=with_webhook(url).delivery)))
        delivery = await wait_for(flaky_receiver, executed[-1].run_id)

    assert flaky_receiver.attempts == 3
    assert delivery["result"]["outcome"] == "OUTCOME_OK"
    assert failed._value.get() == before + 2


async def test_targets_are_refused_before_the_run_starts(make_server, tmp_path, tls) -> None:
    channel, stub = await make_delivering_server(make_server, tmp_path, tls)
    refusals = {}
    async with channel:
        for name, url in [("off the allowlist", "https://example.com/hook"),
                          ("not https", "http://127.0.0.1:1/hook"),
                          ("credentials", "https://user:pw@127.0.0.1/hook"),
                          ("metadata address", "https://169.254.169.254/latest")]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.StartRun(with_webhook(url))
            info = [d for d in status_details(refused.value)
                    if isinstance(d, error_details_pb2.ErrorInfo)]
            refusals[name] = (refused.value.code(), info[0].reason if info else "")
        request = tool_service_pb2.StartRunRequest(tool_name="echo", arguments_json="{}")
        request.delivery.redis_stream.stream = "results"
        with pytest.raises(grpc.aio.AioRpcError) as no_fleet:
            await stub.StartRun(request)
        still = await collect(stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="echo", arguments_json='{"text": "x"}')))

    assert refusals == {
        "off the allowlist": (grpc.StatusCode.PERMISSION_DENIED, "DELIVERY_NOT_ALLOWED"),
        "not https": (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        "credentials": (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        "metadata address": (grpc.StatusCode.PERMISSION_DENIED, "DELIVERY_NOT_ALLOWED"),
    }
    assert no_fleet.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert still[-1].result.outcome == events_pb2.OUTCOME_OK


def test_the_signature_is_what_the_example_receiver_and_the_sdk_verify() -> None:
    body = json.dumps({"run_id": "r1"}).encode()
    header = sign(KEY, body, 1_700_000_000)

    assert verify(KEY, header, body, now=1_700_000_100)
    assert receiver_module.verify(KEY, header, body, now=1_700_000_100)
    assert not receiver_module.verify(KEY, header, body + b" ", now=1_700_000_100)
    assert not receiver_module.verify(b"another key", header, body, now=1_700_000_100)
    assert not receiver_module.verify(KEY, header, body, now=1_700_000_000 + 301)
    assert not receiver_module.verify(KEY, "v1=" + header.partition("v1=")[2], body)


async def _delivery_records(server, run_id: str, expected: int = 1) -> list:
    """The audit records of the deliveries of ``run_id``, once ``expected`` are written
    (a delivery's final state is recorded right after it is known; bounded wait)."""
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))

    async def written() -> list:
        await audit.writer.flush()
        found = [r async for r in audit.writer.store.scan()
                 if r.method == DELIVERY_METHOD and r.run_id == run_id]
        return found if len(found) >= expected else []

    return await eventually(written, within=30, interval=0.05,
                            what=f"{expected} delivery records of {run_id}")


async def test_each_delivery_s_final_state_is_an_audit_record(
        make_server, tmp_path, tls, flaky_receiver) -> None:
    secret = tmp_path / "delivery.key"
    secret.write_bytes(KEY)
    server = await make_server(delivery_allowlist=["127.0.0.1"],
                               delivery_allowed_networks=["127.0.0.1/32"],
                               delivery_webhook_secret_file=secret,
                               delivery_ca_file=tls["tls_client_ca_file"],
                               # A window that holds the flaky receiver's three attempts
                               # however slow a loaded machine makes each TLS handshake.
                               delivery_retry_initial_seconds=0.05,
                               delivery_retry_max_interval_seconds=0.2,
                               delivery_retry_seconds=3.0)
    good = f"https://127.0.0.1:{flaky_receiver.server_address[1]}/hook?token=s3cret"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        delivered = await stub.StartRun(with_webhook(good))
        # Nobody listens on this port: every attempt fails until the window closes.
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            dead = f"https://127.0.0.1:{unused.getsockname()[1]}/hook"
        given_up = await stub.StartRun(with_webhook(dead))
        [ok] = await _delivery_records(server, delivered.run_id)
        [failed] = await _delivery_records(server, given_up.run_id)

    assert (ok.outcome, ok.tool) == ("ok", "echo")
    assert ok.detail.startswith("webhook https://127.0.0.1:") and "delivered after 3 " \
        "attempts" in ok.detail
    assert "s3cret" not in ok.detail  # the URL's token is scrubbed like any audited text
    assert failed.outcome == "failed" and "failed after" in failed.detail


def _contract_comment(message: str) -> str:
    """The comment of a message of the contract, as server reflection serves it (the
    descriptor set made from protos/ with its comments)."""
    files = descriptor_pb2.FileDescriptorSet.FromString(
        (Path(stargrpc.v1.__file__).parent / "descriptors.binpb").read_bytes())
    for file in files.file:
        for index, described in enumerate(file.message_type):
            if described.name == message:
                for location in file.source_code_info.location:
                    if list(location.path) == [4, index]:  # FileDescriptorProto.message_type
                        return location.leading_comments
    raise AssertionError(f"no message {message} in the contract")


async def test_a_delivery_given_up_is_what_the_contract_says_an_audit_record_not_a_notice(
        make_server, tmp_path, tls) -> None:
    secret = tmp_path / "delivery.key"
    secret.write_bytes(KEY)
    server = await make_server(delivery_allowlist=["127.0.0.1"],
                               delivery_allowed_networks=["127.0.0.1/32"],
                               delivery_webhook_secret_file=secret,
                               delivery_ca_file=tls["tls_client_ca_file"],
                               delivery_retry_initial_seconds=0.05,
                               delivery_retry_seconds=0.2)
    with socket.socket() as unused:  # nobody listens there: every attempt fails
        unused.bind(("127.0.0.1", 0))
        dead = f"https://127.0.0.1:{unused.getsockname()[1]}/hook"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        given_up = await stub.StartRun(with_webhook(dead))
        [record] = await _delivery_records(server, given_up.run_id)
        events = await collect(stub.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=given_up.run_id)))
    comment = " ".join(_contract_comment("Delivery").split())

    # The run's log ended with its Result, before the delivery was given up: nothing after.
    assert events[-1].HasField("result") and events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert not [e for e in events if e.HasField("notice")
                and e.notice.code == "DELIVERY_FAILED"]
    assert (record.method, record.outcome) == (DELIVERY_METHOD, "failed")
    # ... and the contract promises exactly that: the audit record, no notice in the log.
    assert f"audit record (method `{DELIVERY_METHOD}`, outcome `failed`)" in comment
    assert "Notice with code DELIVERY_FAILED in the run's log" not in comment


class _BombingHandler(http.server.BaseHTTPRequestHandler):
    """Answers every POST 200 with a gzip body inflating to :data:`_BOMB_BYTES`."""

    body = b""
    posts = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        type(self).posts += 1
        self.send_response(200)
        self.send_header("content-encoding", "gzip")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


_BOMB_BYTES = 256 * 1024 * 1024


def _gzip_of_zeros(size: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip format
    chunk = bytes(1024 * 1024)
    return b"".join([*(packer.compress(chunk) for _ in range(size // len(chunk))),
                     packer.flush()])


async def test_a_receiver_answering_with_a_compression_bomb_costs_the_server_nothing(
        make_server, tmp_path, tls) -> None:
    """Only the receiver's status counts: its body (here 256 MB of zeros in ~250 KB of gzip)
    is never read, let alone inflated into the server's memory."""
    _BombingHandler.body = _gzip_of_zeros(_BOMB_BYTES)
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BombingHandler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls["tls_cert_file"], tls["tls_key_file"])
    receiver.socket = context.wrap_socket(receiver.socket, server_side=True)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    delivered = metrics.DELIVERIES.labels("webhook", "delivered")
    before = delivered._value.get()
    tracemalloc.start()
    try:
        channel, stub = await make_delivering_server(make_server, tmp_path, tls)
        url = f"https://127.0.0.1:{receiver.server_address[1]}/hook"
        async with channel:
            await stub.StartRun(with_webhook(url))

            async def made() -> bool:
                return delivered._value.get() == before + 1

            await eventually(made, within=30, interval=0.05, what="the delivery made")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        receiver.shutdown()
        receiver.server_close()
        thread.join(5)

    assert _BombingHandler.posts == 1
    assert peak < 64 * 1024 * 1024, f"the server held {peak / 2**20:.0f} MiB at its peak"
