"""``stargrpc serve``: run the server in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click
import structlog
from pydantic import ValidationError

from stargrpc.cli.keys import announce_first_key
from stargrpc.errors import AuthConfigError, ToolDefinitionError
from stargrpc.logs import configure_logging
from stargrpc.server import StargrpcServer
from stargrpc.settings import Settings


@click.command()
@click.option("--host", default=None, help="Address to listen on [env STARGRPC_HOST; "
              "default 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port [env STARGRPC_PORT; default 50051].")
@click.option("--tools-dir", "tools_dir", multiple=True, type=click.Path(path_type=Path),
              help="Add a tools directory (repeatable) [env STARGRPC_TOOLS_DIR].")
@click.option("--config", "config_file", type=click.Path(path_type=Path, exists=True),
              default=None, help="A TOML settings file [env STARGRPC_CONFIG].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default=None, help="[env STARGRPC_LOG_LEVEL; default info]")
@click.option("--log-format", type=click.Choice(["auto", "json", "console"]), default=None,
              help="[env STARGRPC_LOG_FORMAT; default auto]")
@click.option("--shutdown-grace", "shutdown_grace_seconds", type=float, default=None,
              help="Seconds runs in flight get after SIGTERM [env "
              "STARGRPC_SHUTDOWN_GRACE_SECONDS; default 30].")
@click.option("--critic-soft-timeout", "critic_soft_timeout", type=float, default=None,
              help="Seconds a run may go without progress before it is stopped [env "
              "STARGRPC_CRITIC_SOFT_TIMEOUT; default 90].")
@click.option("--critic-hard-timeout", "critic_hard_timeout", type=float, default=None,
              help="Seconds a run may take at most [env STARGRPC_CRITIC_HARD_TIMEOUT; "
              "default 900].")
@click.option("--redis-url", "redis_url", default=None, help="Share runs, idempotency keys "
              "and leases with other replicas through this Redis (redis://host:6379/0) [env "
              "STARGRPC_REDIS_URL; default: in this process only].")
@click.option("--insecure-no-auth", "insecure_no_auth", is_flag=True, default=None,
              help="Turn authentication OFF for local experiments: every caller holds every "
              "role [env STARGRPC_INSECURE_NO_AUTH].")
@click.option("--keys-file", "keys_file", type=click.Path(path_type=Path), default=None,
              help="API keys file [env STARGRPC_KEYS_FILE; default <state_dir>/keys.json].")
@click.option("--audit-store", "audit_store", default=None,
              help="Where audit records go: sqlite:///PATH or postgresql://… [env "
              "STARGRPC_AUDIT_STORE; default sqlite:///<state_dir>/audit.db].")
@click.option("--http-port", "http_port", type=int, default=None,
              help="Serve the HTTP gateway and the live progress page on this port [env "
              "STARGRPC_HTTP_PORT; default off].")
@click.option("--metrics-port", "metrics_port", type=int, default=None,
              help="Serve Prometheus metrics at /metrics on this port [env "
              "STARGRPC_METRICS_PORT; default off].")
@click.option("--mcp-port", "mcp_port", type=int, default=None,
              help="Serve the tools as a streamable-HTTP MCP endpoint at /mcp on this port "
              "[env STARGRPC_MCP_PORT; default off].")
@click.option("--tracing/--no-tracing", "tracing", default=None,
              help="Record OpenTelemetry traces (OTLP, set up by the OTEL_EXPORTER_OTLP_* "
              "variables) [env STARGRPC_TRACING; default off].")
def serve(config_file: Path | None, tools_dir: tuple[Path, ...], **flags: object) -> None:
    """Run the stargrpc server."""
    overrides = dict(flags)
    if tools_dir:
        overrides["tools_dir"] = list(tools_dir)
    try:
        settings = Settings.load(config_file, **overrides)
    except ValidationError as exc:
        raise click.UsageError(f"invalid settings:\n{exc}") from exc
    configure_logging(settings.log_level, settings.log_format, cache=True)
    log = structlog.get_logger("stargrpc.cli")
    log.info("settings", **settings.masked())
    try:
        announce_first_key(settings)
        asyncio.run(_serve(settings))
    except AuthConfigError as exc:
        click.echo(f"stargrpc: cannot start: {exc}", err=True)
        sys.exit(4)
    except ToolDefinitionError as exc:
        log.error("tools_failed_to_load", error=str(exc))
        click.echo(f"stargrpc: cannot start: {exc}", err=True)
        sys.exit(3)
    except OSError as exc:
        click.echo(f"stargrpc: cannot start: {exc}", err=True)
        sys.exit(4)


async def _serve(settings: Settings) -> None:
    server = StargrpcServer(settings)
    await server.serve_forever()
