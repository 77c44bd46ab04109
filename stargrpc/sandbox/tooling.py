""":func:`run_in_sandbox`: what a tool calls to run a command in the sandbox and report it.

It opens a step, streams stdout/stderr as DELTAs on it (``channel="stdout"``/``"stderr"``),
heartbeats while the command runs, appends the run's steering messages to ``$STEER_FILE``
(see :mod:`stargrpc.sandbox.runner`), hands the output-folder files back as sent files and
turns the end of the command into a :class:`~stargrpc.ToolResult`: OK for exit status 0,
TIMEOUT for the wall clock, FAILED with the specific reason otherwise. What the command's
process tree used goes into the run's receipt (``ctx.usage``, ``Result.usage``).

What the Result says, on every face (gRPC, the HTTP gateway, MCP):

- ``output`` is what the command printed, all of it as it streamed: stdout, then
  ``[stderr]`` and stderr when it wrote any, then the verdict in brackets
  (``[exited with status 0]``). It is the DELTAs of the step put together, so it is bounded
  by the same ``sandbox_output_bytes`` and, past it, ends that stream with the same marker
  (``[output truncated: more than N bytes; the rest was discarded]``). A Result too large
  for one event keeps its beginning and moves the whole text into a sent file
  (:mod:`stargrpc.runs.result_fit`); MCP shows a documented length of it and links to the
  rest (:mod:`stargrpc.mcp.mapping`).
- ``structured_output`` is about the run, not what it printed: ``{exit_status, signal,
  verdict, reason, cpu_seconds, duration_seconds, output_truncated, isolation, files,
  skipped_files}``. MCP carries it in ``_meta``, never as the tool's structured content.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The public tool API, as any tool author's helper would use it.
from stargrpc import Outcome, ToolContext, ToolFailed, ToolResult
from stargrpc.sandbox.policy import Policy, decide
from stargrpc.sandbox.runner import (
    Sandbox,
    SandboxResult,
    TreeUsage,
    WorkdirUnavailable,
    setup_failed_message,
)
from stargrpc.sandbox.state_socket import open_state_socket
from stargrpc.settings import Settings

#: How long a policy decision holds: it stats the server's secret files (in a thread), so
#: it is taken again at most this often — a secret made readable is refused within it.
POLICY_SECONDS = 1.0
#: The last decision for each settings object: (settings, when, policy).
_decided: dict[int, tuple[Settings, float, Policy]] = {}


async def _policy(settings: Settings) -> Policy:
    """:func:`decide` for ``settings``, at most :data:`POLICY_SECONDS` old."""
    now = time.monotonic()
    held = _decided.get(id(settings))
    if held is not None and held[0] is settings and now - held[1] < POLICY_SECONDS:
        return held[2]
    policy = await asyncio.to_thread(decide, settings)
    if len(_decided) > 64:  # settings objects come and go in tests and embedders
        _decided.clear()
    _decided[id(settings)] = (settings, now, policy)
    return policy


class _CommandFailed(Exception):
    """Raised inside the step so it ends with status ERROR; never leaves this module."""


async def run_in_sandbox(ctx: ToolContext, argv: list[str], *, title: str,
                         files: Mapping[str, str | bytes] | None = None,
                         env: Mapping[str, str] | None = None) -> ToolResult:
    """Runs ``argv`` in the sandbox configured in ``ctx.settings`` and reports it.

    Args:
        ctx: The tool's context.
        argv: The command, looked up on the sandbox PATH.
        title: Title of the step the command runs in.
        files: Input files for the working directory.
        env: Extra environment variables.

    Returns:
        The tool's result, with structured output ``{exit_status, signal, verdict, reason,
        cpu_seconds, duration_seconds, output_truncated, isolation, files, skipped_files}``.
    """
    policy = await _policy(ctx.settings)
    if policy.refusal is not None:
        raise ToolFailed(policy.refusal, code="SANDBOX_UNAVAILABLE")
    try:
        sandbox = Sandbox(ctx.settings)
    except (RuntimeError, OSError) as exc:  # the configured isolation does not work here
        raise ToolFailed(f"the sandbox is unavailable: {exc}", code="SANDBOX_UNAVAILABLE") \
            from exc
    wall_clock = sandbox.limits.wall_clock_seconds

    async def on_tick(elapsed: float) -> None:
        await ctx.heartbeat(f"running for {elapsed:.0f} s", progress=min(elapsed / wall_clock,
                                                                          1.0))

    def on_usage(tree: TreeUsage) -> None:
        # The command's process tree, into the run's receipt (Result.usage): told also
        # when the run is stopped mid-command, which returns no SandboxResult.
        ctx.usage.add_processes(cpu_user_seconds=tree.cpu_user_seconds,
                                cpu_system_seconds=tree.cpu_system_seconds,
                                peak_rss_bytes=tree.peak_rss_bytes,
                                bytes_written=tree.bytes_written)

    result: SandboxResult | None = None
    # The run's own state, reached by the command through an inherited socket.
    try:
        state_socket = open_state_socket(ctx, sandbox.root)
    except OSError as exc:  # its client is written under sandbox_root on the first call
        raise ToolFailed(setup_failed_message(exc, "the run's state socket"),
                         code="SANDBOX_UNAVAILABLE") from exc
    try:
        async with ctx.step(title, kind="sandbox",
                            detail={"isolation": sandbox.isolation.mode}) as step:

            async def on_output(channel: str, text: str) -> None:
                await step.delta(text, channel=channel)

            extra_env = dict(env or {})
            pass_fds: tuple[int, ...] = ()
            shown: tuple[Path, ...] = ()
            adopt_state = None
            if state_socket is not None:
                extra_env.update(state_socket.env)
                pass_fds, shown = state_socket.pass_fds, state_socket.read_only_paths
                adopt_state = state_socket.adopt  # (a pooled sandbox's own, at hand-out)
            result = await sandbox.run(argv, files=files, env=extra_env, on_output=on_output,
                                       on_tick=on_tick, steering=ctx.steering(),
                                       on_usage=on_usage, pass_fds=pass_fds,
                                       read_only_paths=shown, adopt_state=adopt_state)
            step.summary = result.verdict.message
            if not result.verdict.ok:
                raise _CommandFailed
    except _CommandFailed:
        pass
    except WorkdirUnavailable as exc:
        # The server's trouble, not the command's: said as such, never an internal error.
        raise ToolFailed(setup_failed_message(exc), code="SANDBOX_UNAVAILABLE") from exc
    finally:
        if state_socket is not None:
            await state_socket.aclose()
    assert result is not None
    for sent in result.files:
        ctx.send_file(sent.name, sent.data, sent.mime_type)
    return _tool_result(result)


def _tool_result(result: SandboxResult) -> ToolResult:
    parts = []
    if result.stdout:
        parts.append(result.stdout)
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr)
    parts.append(f"[{result.verdict.message}]")
    structured: dict[str, Any] = {
        "exit_status": result.exit_status,
        "signal": result.exit_signal,
        "verdict": result.verdict.code,
        "reason": result.verdict.message,
        "cpu_seconds": round(result.cpu_seconds, 3),
        "duration_seconds": round(result.duration, 3),
        "output_truncated": result.output_truncated,
        "isolation": result.isolation,
        "files": [sent.name for sent in result.files],
        "skipped_files": result.skipped_files,
    }
    text = "\n".join(part.rstrip("\n") for part in parts)
    if result.verdict.ok:
        return ToolResult(output=text, structured=structured)
    outcome = Outcome.TIMEOUT if result.verdict.code == "WALL_CLOCK_LIMIT" else Outcome.FAILED
    return ToolResult(output=text, outcome=outcome, structured=structured,
                      error_message=result.verdict.message, error_code=result.verdict.code)
