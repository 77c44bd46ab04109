"""``stargrpc approve`` and ``stargrpc deny``: decide on a run that waits for approval
(ApproveRun). ``stargrpc runs --state awaiting_approval`` lists what waits."""

from __future__ import annotations

from typing import Any

import click

from stargrpc.cli.client_commands import _fail, connection_options
from stargrpc.client import Client, ClientError


def _decide(client_options: dict[str, Any], run_id: str, approval_id: str, reason: str,
            arguments_digest: str, *, deny: bool) -> None:
    with Client(**client_options) as client:
        try:
            reply = client.approve(run_id, approval_id, reason=reason,
                                   arguments_digest=arguments_digest, deny=deny, timeout=30)
        except ClientError as exc:
            _fail(exc)
    click.echo(f"{'denied' if deny else 'approved'} run {reply.run_id} "
               f"(arguments sha256 {reply.arguments_digest})", err=True)


def _decision_options(command: Any) -> Any:
    for option in reversed([
            click.argument("run_id"),
            click.option("--approval-id", required=True,
                         help="The approval id of the run's request (its APPROVAL_REQUIRED "
                              "notice, or `stargrpc runs --state awaiting_approval`)."),
            click.option("--reason", default="", help="Why; a denied run's Result says it."),
            click.option("--arguments-digest", default="",
                         help="The arguments' sha256 you were shown: refused if the run's "
                              "arguments are not those.")]):
        command = option(command)
    return command


@click.command()
@connection_options
@_decision_options
def approve(client_options: dict[str, Any], run_id: str, approval_id: str, reason: str,
            arguments_digest: str) -> None:
    """Approve a run that waits for approval: it starts. Needs the approver role."""
    _decide(client_options, run_id, approval_id, reason, arguments_digest, deny=False)


@click.command()
@connection_options
@_decision_options
def deny(client_options: dict[str, Any], run_id: str, approval_id: str, reason: str,
         arguments_digest: str) -> None:
    """Deny a run that waits for approval: it ends DENIED (APPROVAL_DENIED) with the
    reason. Needs the approver role."""
    _decide(client_options, run_id, approval_id, reason, arguments_digest, deny=True)
