"""``stargrpc doctor``: what the sandbox protects here, and which secrets a run could read.

It takes the same flags, environment and settings file as ``stargrpc serve`` and reports:
the isolation mode ``serve`` would pick, what it protects and what it does not, which
sandboxed tools would be disabled, which of the server's secrets a sandboxed run could
read, and the one change that fixes each finding.

Exit status: 0 when sandboxed tools would run with nothing of the server's reachable (or
there are none); 1 when a sandboxed tool would run with isolation that leaves secrets
reachable (weaker than safe, whatever allowed it); 3 when the sandboxed tools would be
disabled (fail-closed); 2 for invalid settings.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from stargrpc.cli.serve import settings_from_flags, settings_options
from stargrpc.errors import ToolDefinitionError
from stargrpc.sandbox.isolation import GAPS
from stargrpc.sandbox.policy import decide, secret_files
from stargrpc.secret_env import secret_variables
from stargrpc.server.grpc_server import load_tools
from stargrpc.settings import Settings

#: Exit statuses.
EXIT_OK, EXIT_WEAK, EXIT_DISABLED = 0, 1, 3


@click.command()
@settings_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def doctor(config_file: Path | None, tools_dir: tuple[Path, ...], as_json: bool,
           **flags: object) -> None:
    """Check what sandboxed tools would get here and which secrets they could read."""
    settings = settings_from_flags(config_file, tools_dir, flags)
    report = build_report(settings)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render(report))
    sys.exit(report["exit_status"])


def build_report(settings: Settings) -> dict[str, Any]:
    """The doctor's findings, as JSON-ready values."""
    try:
        registry = load_tools(settings)
        tools = sorted(spec.name for spec in registry.values() if spec.kind == "sandbox")
        tools_error = None
    except ToolDefinitionError as exc:
        tools, tools_error = [], str(exc)
    policy = decide(settings)
    isolation = policy.isolation
    fixes: list[str] = []
    if policy.refusal is not None:
        fixes.append(policy.fix or policy.refusal)
    fixes += [f"{place.what} {place.path}: {place.fix}" for place in policy.reachable
              if policy.refusal is None]
    environment = []
    for name in sorted(secret_variables(os.environ)):
        field = name.removeprefix("STARGRPC_").lower()
        fix = (f"use {field}_file" if field in ("jwt_secret", "fleet_secret")
               else "put it in the settings file (readable by the server's user only)")
        environment.append({"variable": name, "fix": fix,
                            "note": "stargrpc serve removes it from /proc/<server>/environ at "
                            "start-up; it stays visible where it was set (shell, docker "
                            "inspect, the pod spec)"})
        fixes.append(f"{name}: {fix}")
    files = [{"what": what, "path": str(path), "reachable": any(
        place.path == str(path) for place in policy.reachable)}
        for what, path, _ in secret_files(settings)]
    if not tools:
        status = EXIT_OK
    elif policy.refusal is not None:
        status = EXIT_DISABLED
    else:
        status = EXIT_WEAK if policy.weak else EXIT_OK
    return {
        "isolation": {
            "wanted": settings.sandbox_isolation,
            "minimum": settings.sandbox_isolation_min,
            "mode": isolation.mode if isolation else None,
            "protects": isolation.description if isolation else None,
            "does_not_protect": GAPS[isolation.mode] if isolation else None,
            "skipped": dict(isolation.skipped) if isolation else {},
            "user": policy.user,
        },
        "sandboxed_tools": tools,
        "tools_error": tools_error,
        "disabled": bool(tools) and policy.refusal is not None,
        "disabled_reason": policy.refusal,
        "weak": policy.weak,
        "weak_reasons": policy.weak_reasons,
        "allowed_by": policy.allowed_by,
        "secret_files": files,
        "reachable": [{"what": p.what, "path": p.path, "fix": p.fix} for p in policy.reachable],
        "environment": environment,
        "fixes": fixes,
        "exit_status": status,
    }


def render(report: dict[str, Any]) -> str:
    """The report for people."""
    iso = report["isolation"]
    lines = [f"isolation: {iso['mode'] or 'none works here'} (sandbox_isolation="
             f"{iso['wanted']}, sandbox_isolation_min={iso['minimum']})"]
    for mode, reason in iso["skipped"].items():
        lines.append(f"  not {mode}: {reason}")
    if iso["mode"]:
        lines += [f"  protects: {iso['protects']}",
                  f"  does not protect: {iso['does_not_protect']}"]
    lines.append(f"  commands run as: {iso['user']}")
    tools = ", ".join(report["sandboxed_tools"]) or "(none)"
    if report["tools_error"]:
        lines.append(f"sandboxed tools: cannot load the tools: {report['tools_error']}")
    elif report["disabled"]:
        lines.append(f"sandboxed tools: {tools} — DISABLED (SANDBOX_UNAVAILABLE): "
                     f"{report['disabled_reason']}")
    elif report["weak"]:
        lines.append(f"sandboxed tools: {tools} — RUN WITH WEAK ISOLATION (allowed by "
                     f"{report['allowed_by']}): " + "; ".join(report["weak_reasons"]))
    else:
        lines.append(f"sandboxed tools: {tools} — run")
    lines.append("secret files (reachable from a sandboxed run?):")
    for item in report["secret_files"]:
        lines.append(f"  {'REACHABLE' if item['reachable'] else 'out of reach'}: "
                     f"{item['what']} {item['path']}")
    lines.append("secrets in the environment:")
    for item in report["environment"]:
        lines.append(f"  {item['variable']}: {item['note']}")
    if not report["environment"]:
        lines.append("  none")
    lines.append("fixes:" if report["fixes"] else "fixes: none needed")
    lines += [f"  - {fix}" for fix in report["fixes"]]
    return "\n".join(lines)
