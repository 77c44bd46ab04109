"""``stargrpc serve``: run the server in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import structlog
from pydantic import ValidationError

from stargrpc.audit.key import AuditKeyError
from stargrpc.cli.keys import announce_first_key
from stargrpc.errors import (
    AuthConfigError,
    CriticConfigError,
    MissingExtra,
    ToolDefinitionError,
)
from stargrpc.logs import configure_logging
from stargrpc.mcp import require_mcp_for
from stargrpc.secret_env import hand_over_and_reexec, take_over
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.workers import WorkerSupervisor
from stargrpc.settings import Settings

#: The settings flags of `stargrpc serve`, shared by `stargrpc doctor`.
SETTINGS_OPTIONS = [
    click.option("--host", default=None, help="Address to listen on [env STARGRPC_HOST; "
                 "default 127.0.0.1]."),
    click.option("--port", type=int, default=None, help="Port [env STARGRPC_PORT; default 50051]."),
    click.option("--tools-dir", "tools_dir", multiple=True, type=click.Path(path_type=Path),
                 help="Add a tools directory (repeatable) [env STARGRPC_TOOLS_DIR]."),
    click.option("--config", "config_file", type=click.Path(path_type=Path, exists=True),
                 default=None, help="A TOML settings file [env STARGRPC_CONFIG]."),
    click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
                 default=None, help="[env STARGRPC_LOG_LEVEL; default info]"),
    click.option("--log-format", type=click.Choice(["auto", "json", "console"]), default=None,
                 help="[env STARGRPC_LOG_FORMAT; default auto]"),
    click.option("--shutdown-grace", "shutdown_grace_seconds", type=float, default=None,
                 help="Seconds runs in flight get after SIGTERM [env "
                 "STARGRPC_SHUTDOWN_GRACE_SECONDS; default 30]."),
    click.option("--critic-soft-timeout", "critic_soft_timeout", type=float, default=None,
                 help="Seconds a run may go without progress before it is stopped [env "
                 "STARGRPC_CRITIC_SOFT_TIMEOUT; default 90]."),
    click.option("--critic-hard-timeout", "critic_hard_timeout", type=float, default=None,
                 help="Seconds a run may take at most [env STARGRPC_CRITIC_HARD_TIMEOUT; "
                 "default 900]."),
    click.option("--critic", "critic", default=None, help="The server's critic: "
                 "module:factory, or the name of a stargrpc.critics entry point [env "
                 "STARGRPC_CRITIC; default: the rules]."),
    click.option("--critic-url", "critic_url", default=None, help="host:port of a remote "
                 "CriticService that judges every run [env STARGRPC_CRITIC_URL; default "
                 "none]."),
    click.option("--redis-url", "redis_url", default=None, help="Share runs, idempotency keys "
                 "and leases with other replicas through this Redis (redis://host:6379/0) [env "
                 "STARGRPC_REDIS_URL; default: in this process only]."),
    click.option("--insecure-no-auth", "insecure_no_auth", is_flag=True, default=None,
                 help="Turn authentication OFF for local experiments: every caller holds every "
                 "role [env STARGRPC_INSECURE_NO_AUTH]."),
    click.option("--keys-file", "keys_file", type=click.Path(path_type=Path), default=None,
                 help="API keys file [env STARGRPC_KEYS_FILE; default <state_dir>/keys.json]."),
    click.option("--audit-store", "audit_store", default=None,
                 help="Where audit records go: sqlite:///PATH or postgresql://… [env "
                 "STARGRPC_AUDIT_STORE; default sqlite:///<state_dir>/audit.db]."),
    click.option("--http-port", "http_port", type=int, default=None,
                 help="Serve the HTTP gateway and the live progress page on this port [env "
                 "STARGRPC_HTTP_PORT; default off]."),
    click.option("--metrics-port", "metrics_port", type=int, default=None,
                 help="Serve Prometheus metrics at /metrics on this port [env "
                 "STARGRPC_METRICS_PORT; default off]."),
    click.option("--mcp-port", "mcp_port", type=int, default=None,
                 help="Serve the tools as a streamable-HTTP MCP endpoint at /mcp on this port "
                 "[env STARGRPC_MCP_PORT; default off]. Needs the mcp extra: pip install "
                 "'stargrpc[mcp]'."),
    click.option("--workers", "workers", default=None, metavar="N|auto",
                 help="Server processes sharing the ports, supervised by this one; 'auto' = "
                 "the cores available; more than one needs --redis-url [env "
                 "STARGRPC_WORKERS; default 1]."),
    click.option("--tracing/--no-tracing", "tracing", default=None,
                 help="Record OpenTelemetry traces (OTLP, set up by the OTEL_EXPORTER_OTLP_* "
                 "variables) [env STARGRPC_TRACING; default off]."),
]


def settings_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the settings flags (and ``--config``) to a command."""
    for option in reversed(SETTINGS_OPTIONS):
        command = option(command)
    return command


@click.command()
@settings_options
def serve(config_file: Path | None, tools_dir: tuple[Path, ...], **flags: object) -> None:
    """Run the stargrpc server."""
    # Only as the program itself: never replace a program that merely embeds this command.
    handover_failed = hand_over_and_reexec() if _is_main_program() else None
    handed_over = take_over()
    overrides = setting_overrides(tools_dir, flags, handed_over)
    settings = settings_from_flags(config_file, tools_dir, flags, handed_over)
    configure_logging(settings.log_level, settings.log_format, cache=True)
    log = structlog.get_logger("stargrpc.cli")
    log.info("settings", **settings.masked())
    if handed_over:
        log.info("secrets_removed_from_environment", settings=sorted(handed_over))
    if handover_failed:
        log.warning("secrets_left_in_environment", reason=handover_failed)
    try:
        require_mcp_for(settings)  # before any worker starts: said once, by the command
        announce_first_key(settings)  # before any worker starts: one key, no race
        if settings.workers > 1:
            sys.exit(asyncio.run(
                WorkerSupervisor(settings, overrides, config_file).run()))
        asyncio.run(_serve(settings))
    except (AuthConfigError, MissingExtra) as exc:
        click.echo(f"stargrpc: cannot start: {exc}", err=True)
        sys.exit(4)
    except (ToolDefinitionError, CriticConfigError) as exc:
        log.error("tools_failed_to_load", error=str(exc))
        click.echo(f"stargrpc: cannot start: {exc}", err=True)
        sys.exit(3)
    except (OSError, AuditKeyError) as exc:
        click.echo(f"stargrpc: cannot start: {exc}", err=True)
        sys.exit(4)


def settings_from_flags(config_file: Path | None, tools_dir: tuple[Path, ...],
                        flags: dict[str, object], below_flags: dict[str, str] | None = None
                        ) -> Settings:
    """The settings a command of :data:`SETTINGS_OPTIONS` was given.

    Args:
        config_file: ``--config``.
        tools_dir: ``--tools-dir``.
        flags: The other flags (None when not given).
        below_flags: Values that rank below the flags, such as handed-over environment
            variables.

    Raises:
        click.UsageError: The settings are invalid.
    """
    try:
        return Settings.load(config_file, **setting_overrides(tools_dir, flags, below_flags))
    except ValidationError as exc:
        raise click.UsageError(f"invalid settings:\n{exc}") from exc


def setting_overrides(tools_dir: tuple[Path, ...], flags: dict[str, object],
                      below_flags: dict[str, str] | None = None) -> dict[str, object]:
    """What :func:`settings_from_flags` loads the settings with, besides the environment and
    the config file (see there for the arguments)."""
    overrides: dict[str, object] = {**(below_flags or {}),
                                    **{k: v for k, v in flags.items() if v is not None}}
    if tools_dir:
        overrides["tools_dir"] = list(tools_dir)
    return overrides


def _is_main_program() -> bool:
    program = sys.argv[0] if sys.argv else ""
    return os.path.basename(program) == "stargrpc" or program.endswith(
        os.path.join("stargrpc", "cli", "__main__.py"))


async def _serve(settings: Settings) -> None:
    server = StargrpcServer(settings)
    await server.serve_forever()
