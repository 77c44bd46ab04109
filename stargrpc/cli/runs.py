"""``stargrpc runs``: the runs the caller may see, newest first (ListRuns)."""

from __future__ import annotations

import json
import time
from typing import Any

import click
from google.protobuf import json_format

from stargrpc.cli.client_commands import _fail, connection_options
from stargrpc.client import Client, ClientError
from stargrpc.v1 import events_pb2, tool_service_pb2

_OUTCOMES = [name.removeprefix("OUTCOME_").lower() for name in events_pb2.Outcome.keys()  # noqa: SIM118 (an enum wrapper)
             if name != "OUTCOME_UNSPECIFIED"]


@click.command()
@connection_options
@click.option("--tool", default="", help="Only runs of this tool.")
@click.option("--state", type=click.Choice(["running", "queued", "finished"]), default=None,
              help="Only runs in this state.")
@click.option("--outcome", type=click.Choice(_OUTCOMES), default=None,
              help="Only runs that ended with this outcome.")
@click.option("--limit", type=click.IntRange(1, 200), default=50, show_default=True,
              help="Runs per page.")
@click.option("--page-token", default="", help="Go on from a previous page.")
@click.option("--json", "as_json", is_flag=True, help="Print the page as JSON.")
def runs(client_options: dict[str, Any], tool: str, state: str | None, outcome: str | None,
         limit: int, page_token: str, as_json: bool) -> None:
    """List runs in flight and recently finished, newest first: your own, or everyone's
    with an operator role. The token of the next page goes to stderr."""
    with Client(**client_options) as client:
        try:
            page = client.list_runs(tool=tool, state=state or "", outcome=outcome or "",
                                    page_size=limit, page_token=page_token, timeout=30)
        except ClientError as exc:
            _fail(exc)
    if as_json:
        click.echo(json.dumps(json_format.MessageToDict(page, preserving_proto_field_name=True),
                              indent=2))
        return
    for run in page.runs:
        click.echo("  ".join(_columns(run)))
    if not page.runs:
        click.echo("no runs", err=True)
    if page.next_page_token:
        click.echo(f"more: --page-token {page.next_page_token}", err=True)


def _columns(run: tool_service_pb2.RunSummary) -> list[str]:
    finished = run.state == tool_service_pb2.RUN_STATE_FINISHED
    queued = run.state == tool_service_pb2.RUN_STATE_QUEUED
    status = (events_pb2.Outcome.Name(run.outcome).removeprefix("OUTCOME_").lower()
              if finished else "queued" if queued else "running")
    started = run.started_at.ToMilliseconds() / 1000
    ended = run.ended_at.ToMilliseconds() / 1000 if run.HasField("ended_at") else time.time()
    columns = [run.run_id, run.tool_name.ljust(12), status.ljust(9),
               time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
               f"{max(0.0, ended - started):8.1f}s"]
    if run.principal:
        columns.append(run.principal)
    if run.current_step:
        columns.append(f"· {run.current_step}")
    if queued:
        columns.append(f"· lane {run.lane or 'default'}, #{run.queue_position} in line")
    return columns
