"""``stargrpc session create|list|close``: a running server's sessions, through the Python
SDK. Run code in one with ``stargrpc call python --session ID --args '{"code": …}'``."""

from __future__ import annotations

import json
from typing import Any

import click
from google.protobuf import json_format

from stargrpc.cli.client_commands import _fail, connection_options, usage_line
from stargrpc.client import Client, ClientError
from stargrpc.v1 import tool_service_pb2


@click.group()
def session() -> None:
    """Open, list and close sessions: sandboxes kept across calls."""


@session.command()
@connection_options
@click.argument("kind", type=click.Choice(["python", "shell"]), default="python")
@click.option("--ttl", "ttl_seconds", type=click.IntRange(min=0), default=0,
              help="Longest life in seconds (0: the server's).")
@click.option("--idle", "idle_seconds", type=click.IntRange(min=0), default=0,
              help="Seconds without a call before it closes (0: the server's).")
@click.option("--memory-mb", type=click.IntRange(min=0), default=0,
              help="Address space of each of its processes (0: the server's).")
@click.option("--cpu-seconds", type=click.IntRange(min=0), default=0,
              help="CPU seconds of each of its processes over its life (0: the server's).")
@click.option("--disk-mb", type=click.IntRange(min=0), default=0,
              help="Disk its folder may hold (0: the server's).")
@click.option("--json", "as_json", is_flag=True, help="Print the session as JSON.")
def create(client_options: dict[str, Any], kind: str, as_json: bool, **limits: int) -> None:
    """Open a session; prints its id (pass it to `stargrpc call --session`)."""
    with Client(**client_options) as client:
        try:
            made = client.create_session(kind, timeout=60, **limits)
        except ClientError as exc:
            _fail(exc)
    if as_json:
        click.echo(_json(made))
        return
    click.echo(made.session_id)


@session.command(name="list")
@connection_options
@click.option("--json", "as_json", is_flag=True, help="Print the sessions as JSON.")
def list_(client_options: dict[str, Any], as_json: bool) -> None:
    """List your open sessions, with what each used so far."""
    with Client(**client_options) as client:
        try:
            sessions = client.list_sessions(timeout=30)
        except ClientError as exc:
            _fail(exc)
    if as_json:
        click.echo(json.dumps([json.loads(_json(s)) for s in sessions], indent=2))
        return
    for item in sessions:
        state = "busy" if item.busy else "idle"
        click.echo(f"{item.session_id}  {item.kind:<6}  {state}  {item.calls} calls  "
                   f"expires {item.expires_at.ToDatetime().isoformat(timespec='seconds')}Z  "
                   f"{usage_line(item.usage)}")


@session.command()
@connection_options
@click.argument("session_id")
def close(client_options: dict[str, Any], session_id: str) -> None:
    """Close a session: its processes end and its files are removed."""
    with Client(**client_options) as client:
        try:
            client.close_session(session_id, timeout=30)
        except ClientError as exc:
            _fail(exc)
    click.echo("closed", err=True)


def _json(message: tool_service_pb2.Session) -> str:
    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True),
                      indent=2)
