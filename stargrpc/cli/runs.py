"""``stargrpc runs``: the runs the caller may see, newest first (ListRuns); ``--tree``
prints one call tree, each run indented under the run that started it."""

from __future__ import annotations

import json
import time
from typing import Any

import click
from google.protobuf import json_format

from stargrpc.cli.client_commands import _fail, connection_options, terminal_safe
from stargrpc.client import Client, ClientError
from stargrpc.v1 import events_pb2, tool_service_pb2

_OUTCOMES = [name.removeprefix("OUTCOME_").lower() for name in events_pb2.Outcome.keys()  # noqa: SIM118 (an enum wrapper)
             if name != "OUTCOME_UNSPECIFIED"]


@click.command()
@connection_options
@click.option("--tool", default="", help="Only runs of this tool.")
@click.option("--state", type=click.Choice(["running", "queued", "awaiting_approval",
                                         "finished"]),
              default=None, help="Only runs in this state (awaiting_approval: with the "
              "approver role, everyone's).")
@click.option("--outcome", type=click.Choice(_OUTCOMES), default=None,
              help="Only runs that ended with this outcome.")
@click.option("--lane", default="", metavar="NAME",
              help="Only runs of this lane (queued, running or finished).")
@click.option("--limit", type=click.IntRange(1, 200), default=50, show_default=True,
              help="Runs per page.")
@click.option("--page-token", default="", help="Go on from a previous page.")
@click.option("--tree", "tree_root", default="", metavar="RUN_ID",
              help="Print the call tree of this root run: every run below it, indented "
              "under the run that started it (every page read).")
@click.option("--json", "as_json", is_flag=True, help="Print the page as JSON.")
def runs(client_options: dict[str, Any], tool: str, state: str | None, outcome: str | None,
         lane: str, limit: int, page_token: str, tree_root: str, as_json: bool) -> None:
    """List runs in flight and recently finished, newest first: your own, or everyone's
    with an operator role. The token of the next page goes to stderr."""
    if tree_root:
        _print_tree(client_options, tree_root, as_json)
        return
    with Client(**client_options) as client:
        try:
            page = client.list_runs(tool=tool, state=state or "", outcome=outcome or "",
                                    lane=lane, page_size=limit, page_token=page_token, timeout=30)
        except ClientError as exc:
            _fail(exc)
    if as_json:
        click.echo(json.dumps(json_format.MessageToDict(page, preserving_proto_field_name=True),
                              indent=2))
        return
    for run in page.runs:
        click.echo(terminal_safe("  ".join(_columns(run))))
    if not page.runs:
        click.echo("no runs", err=True)
    if page.next_page_token:
        click.echo(f"more: --page-token {page.next_page_token}", err=True)


#: Most runs ``--tree`` reads (pages of 200).
MAX_TREE_RUNS = 10_000


def _print_tree(client_options: dict[str, Any], root: str, as_json: bool) -> None:
    """Prints the call tree of ``root``: each run, then the runs it started (oldest first),
    indented one level deeper; exits 1 when the caller sees no such tree."""
    found: list[tool_service_pb2.RunSummary] = []
    token = ""
    with Client(**client_options) as client:
        try:
            while len(found) < MAX_TREE_RUNS:
                page = client.list_runs(root_run_id=root, page_size=200, page_token=token,
                                        timeout=30)
                found.extend(page.runs)
                token = page.next_page_token
                if not token:
                    break
        except ClientError as exc:
            _fail(exc)
    if as_json:
        click.echo(json.dumps([json_format.MessageToDict(run, preserving_proto_field_name=True)
                               for run in found], indent=2))
        return
    children: dict[str, list[tool_service_pb2.RunSummary]] = {}
    for run in sorted(found, key=lambda r: (r.started_at.ToMilliseconds(), r.run_id)):
        children.setdefault(run.parent_run_id, []).append(run)
    tops = [run for run in found if run.run_id == root]
    if not tops:
        click.echo(f"error: no call tree with root {root} (unknown, expired, not yours, or "
                   "not a root: give its root_run_id)", err=True)
        raise SystemExit(1)
    pending = [(tops[0], 0)]
    while pending:
        run, level = pending.pop()
        click.echo(terminal_safe("  " * level + "  ".join(_columns(run))))
        pending.extend((child, level + 1) for child in reversed(children.get(run.run_id, [])))


def _columns(run: tool_service_pb2.RunSummary) -> list[str]:
    finished = run.state == tool_service_pb2.RUN_STATE_FINISHED
    awaiting = run.state == tool_service_pb2.RUN_STATE_AWAITING_APPROVAL
    queued = run.state == tool_service_pb2.RUN_STATE_QUEUED
    status = (events_pb2.Outcome.Name(run.outcome).removeprefix("OUTCOME_").lower()
              if finished else "awaiting" if awaiting else "queued" if queued else "running")
    started = run.started_at.ToMilliseconds() / 1000
    ended = run.ended_at.ToMilliseconds() / 1000 if run.HasField("ended_at") else time.time()
    columns = [run.run_id, run.tool_name.ljust(12), status.ljust(9),
               time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
               f"{max(0.0, ended - started):8.1f}s"]
    if run.principal:
        columns.append(run.principal)
    if run.current_step:
        columns.append(f"· {run.current_step}")
    if awaiting:  # what an approver needs: stargrpc approve RUN_ID --approval-id …
        approval = run.approval
        columns.append(f"approval-id {approval.approval_id} sha256 "
                       f"{approval.arguments_digest} {approval.arguments}")
    if queued:
        columns.append(f"· lane {run.lane or 'default'}, #{run.queue_position} in line")
    return columns
