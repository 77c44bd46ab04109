"""The ``stargrpc`` command line: one module per group of commands."""

from __future__ import annotations

from typing import Any

import click

from stargrpc import __version__
from stargrpc.cli.approve import approve, deny
from stargrpc.cli.audit import audit
from stargrpc.cli.client_commands import call, cancel, steer, tools, watch
from stargrpc.cli.doctor import doctor
from stargrpc.cli.health import health
from stargrpc.cli.kb import kb
from stargrpc.cli.keys import keys
from stargrpc.cli.mcp import mcp_stdio
from stargrpc.cli.new_tool import new_tool
from stargrpc.cli.runs import runs
from stargrpc.cli.serve import serve
from stargrpc.cli.sessions import session
from stargrpc.cli.state import state


class _BadInput(click.ClickException):
    """Input a command passed on that cannot be sent: said in a line, exit 2 (as a usage
    error), not a traceback."""

    exit_code = 2


class _Main(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ValueError, RecursionError) as exc:
            if ctx.invoked_subcommand == "serve":
                raise  # the server's own fault, with its traceback: not input to refuse
            raise _BadInput(_why(exc)) from exc


def _why(exc: ValueError | RecursionError) -> str:
    """What was wrong with the input, in a line."""
    if isinstance(exc, UnicodeError):  # bytes that are not UTF-8 (kept by surrogateescape)
        return "an argument is not UTF-8 text"
    if isinstance(exc, RecursionError):
        return "an argument is nested too deeply"
    return str(exc) or type(exc).__name__  # a number past its field, a key no header takes


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """stargrpc: run tools for AI agents over gRPC, and talk to a running server."""


@main.command()
def version() -> None:
    """Print the stargrpc version."""
    click.echo(__version__)


main.add_command(serve)
main.add_command(doctor)
main.add_command(audit)
main.add_command(tools)
main.add_command(call)
main.add_command(watch)
main.add_command(cancel)
main.add_command(steer)
main.add_command(approve)
main.add_command(deny)
main.add_command(session)
main.add_command(runs)
main.add_command(state)
main.add_command(health)
main.add_command(keys)
main.add_command(kb)
main.add_command(mcp_stdio)
main.add_command(new_tool)

__all__ = ["main"]
