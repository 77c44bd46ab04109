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


@click.command("mcp-stdio")
@connection_options
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="warning", show_default=True,
              help="Log lines (JSON, on stderr: stdout carries the MCP messages).")
def mcp_stdio(client_options: dict[str, Any], log_level: str) -> None:
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
        key_file=client_options["key_file"]))
