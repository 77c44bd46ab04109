"""What the delivery tests share: the example webhook receiver and its key, a server that
delivers to it, the StartRun requests that ask for a delivery, and the reading of a
Redis stream delivery's entry."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import grpc
from redis.asyncio import Redis

from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import ServerFactory

EXAMPLE = Path(__file__).parents[2] / "examples" / "webhook_receiver.py"
KEY = b"a delivery key for tests"

Stub = tool_service_pb2_grpc.ToolServiceStub


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("webhook_receiver", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


#: ``examples/webhook_receiver.py``, loaded once.
receiver_module = _example()


async def make_delivering_server(make_server: ServerFactory, tmp_path: Path,
                                 tls: dict[str, Path]) -> tuple[grpc.aio.Channel, Stub]:
    """A server that delivers webhooks to loopback (signed with :data:`KEY`, trusting the
    test CA, retrying fast); a channel to it and its stub."""
    secret = tmp_path / "delivery.key"
    secret.write_bytes(KEY + b"\n")
    server = await make_server(delivery_allowlist=["127.0.0.1"],
                               delivery_allowed_networks=["127.0.0.1/32"],
                               delivery_webhook_secret_file=secret,
                               delivery_ca_file=tls["tls_client_ca_file"],
                               delivery_retry_initial_seconds=0.05,
                               delivery_retry_seconds=30)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return channel, tool_service_pb2_grpc.ToolServiceStub(channel)


def with_webhook(url: str, **fields) -> tool_service_pb2.StartRunRequest:
    """A StartRun of ``echo`` whose Result is delivered to the webhook at ``url``."""
    request = tool_service_pb2.StartRunRequest(tool_name="echo",
                                               arguments_json='{"text": "delivered"}', **fields)
    request.delivery.webhook.url = url
    return request


def start_request(tool_name: str, arguments: dict, stream: str
                  ) -> tool_service_pb2.StartRunRequest:
    """A StartRun whose Result is added to the Redis stream ``stream``."""
    request = tool_service_pb2.StartRunRequest(tool_name=tool_name,
                                               arguments_json=json.dumps(arguments))
    request.delivery.redis_stream.stream = stream
    return request


async def read_entry(redis: Redis, key: str, run_id: str, within: float) -> dict:
    """The first entry of stream ``key`` for ``run_id``, waited for (bounded)."""
    last = "0-0"
    async with asyncio.timeout(within):
        while True:
            reply = await redis.xread({key: last}, count=10, block=500)
            for _, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    decoded = {k.decode(): v.decode() for k, v in fields.items()}
                    if decoded["run_id"] == run_id:
                        return decoded
