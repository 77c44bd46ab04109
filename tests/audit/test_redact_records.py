"""Redaction through a real server: what a call's record keeps (arguments, result text,
detail) and what the audit log line prints, for the secret spellings the key-name and text
rules catch."""

from __future__ import annotations

import io
import json
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict

from stargrpc import ToolContext, ToolFailed, tool
from stargrpc.audit.record import AuditRecord
from stargrpc.registry import Registry, spec_of
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import tool_service_pb2_grpc
from tests.conftest import ServerFactory
from tests.helpers import run_tool

# Every secret below contains this marker; nothing stored or logged may.
MARK = "SECRET"


class Connect(BaseModel):
    model_config = ConfigDict(extra="allow")

    target: str


@tool(privileged=True)
async def connect(ctx: ToolContext, args: Connect) -> str:
    """A privileged tool: logged with its arguments at WARNING."""
    return (f"connected to postgresql://app:pw-{MARK}@db/prod with "
            f"Authorization: Bearer tok-{MARK}; see https://h.example/x?api_key=k-{MARK}")


@tool()
async def refuse(ctx: ToolContext) -> str:
    """Fails with a detail that quotes a DSN."""
    raise ToolFailed(f"cannot reach host=db password=dsn-{MARK} dbname=app")


def _registry() -> Registry:
    return Registry(spec for spec in (spec_of(connect), spec_of(refuse)) if spec is not None)


async def _records(server: StargrpcServer) -> list[AuditRecord]:
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await audit.writer.flush()
    return [r async for r in audit.writer.store.scan()]


async def test_secrets_in_arguments_results_details_and_log_lines_are_redacted(
        make_server: ServerFactory,
        log_lines: io.StringIO) -> None:
    server = await make_server(registry=_registry(),
                               tool_permissions={"connect": {"roles": ["*"]}})
    arguments: dict[str, Any] = {
        "target": f"redis://:r-{MARK}@cache:6379/0",
        "dbPassword": f"a-{MARK}", "apiKey": f"b-{MARK}", "accessToken": f"c-{MARK}",
        "clientSecret": f"d-{MARK}", "jwt": f"e-{MARK}", "pin": f"f-{MARK}",
        "passcode": f"g-{MARK}", "private_key": f"h-{MARK}",
        "headers": {"X-Api-Key": f"i-{MARK}", "x-auth-token": f"j-{MARK}"},
        "note": f"mirror at https://u:n-{MARK}@m.example/x, query ?token=q-{MARK}&page=2",
        "keyboard": "us", "spinner": "dots", "tokenizer": "bpe", "author": "ann",
    }
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        connected = await run_tool(stub, "connect", arguments)
        refused = await run_tool(stub, "refuse")

    assert MARK in connected[-1].result.output  # the client gets what the tool returned
    assert MARK in refused[-1].result.error.message
    records = await _records(server)
    assert [record.tool for record in records] == ["connect", "refuse"]
    assert MARK not in json.dumps([record.as_dict() for record in records])
    assert MARK not in log_lines.getvalue()

    shown = json.loads(records[0].arguments)
    assert shown["target"] == "redis://:<redacted>@cache:6379/0"
    assert {key: shown[key] for key in ("keyboard", "spinner", "tokenizer", "author")} == {
        "keyboard": "us", "spinner": "dots", "tokenizer": "bpe", "author": "ann"}
    assert "postgresql://app:<redacted>@db/prod" in records[0].result
    assert "password=<redacted> dbname=app" in records[1].detail
    [logged] = [json.loads(line) for line in log_lines.getvalue().splitlines()
                if line.startswith("{") and '"connect"' in line and '"audit"' in line]
    assert logged["level"] == "warning"
    assert json.loads(logged["arguments"]) == shown
