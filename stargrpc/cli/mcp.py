"""``stargrpc mcp-stdio``: a stargrpc server's tools for an MCP client that launches
commands (desktop MCP clients), over stdin/stdout."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click

from stargrpc.cli.client_commands import connection_options
from stargrpc.errors import MissingExtra
from stargrpc.logs import configure_logging
from stargrpc.mcp import require_mcp
from stargrpc.settings import Settings

_PROGRESS_AFTER = Settings.model_fields["mcp_progress_after_seconds"]


@click.command("mcp-stdio")
@connection_options
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="warning", show_default=True,
              help="Log lines (JSON, on stderr: stdout carries the MCP messages).")
@click.option("--progress-after-seconds", type=click.FloatRange(0, 3600),
              default=_PROGRESS_AFTER.default, show_default=True,
              envvar="STARGRPC_MCP_PROGRESS_AFTER_SECONDS",
              help="How long a call runs before its events reach the MCP client "
              "(mcp_progress_after_seconds; 0: from the start).")
def mcp_stdio(client_options: dict[str, Any], log_level: str,
              progress_after_seconds: float) -> None:
    """Serve a stargrpc server's tools as an MCP server over stdio (needs the mcp extra:
    pip install 'stargrpc[mcp]')."""
    try:
        require_mcp("stargrpc mcp-stdio")
    except MissingExtra as exc:
        raise click.ClickException(str(exc)) from None
    from stargrpc.mcp.stdio import serve_stdio

    configure_logging(log_level, "json", sys.stderr)
    ca_file: Path | None = client_options["ca_file"]
    asyncio.run(serve_stdio(
        client_options["target"], api_key=client_options["api_key"],
        tls=client_options["tls"], ca_file=ca_file, cert_file=client_options["cert_file"],
        key_file=client_options["key_file"], progress_after_seconds=progress_after_seconds))
