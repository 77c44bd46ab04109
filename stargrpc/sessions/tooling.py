""":func:`run_in_session`: what the ``python`` and ``shell`` tools call when their run has a
session (``ctx.session``), instead of :func:`stargrpc.sandbox.run_in_sandbox`.

The run holds the session's turn already (:meth:`SessionHandle.hold`: calls in one session
run one at a time). It opens a step, streams the call's stdout/stderr as DELTAs on it
(``channel="stdout"``/``"stderr"``) and turns the end of the call into a
:class:`~stargrpc.ToolResult`:

- ``python``: OK when the code ran to its end; ``structured_output`` is the value of a
  final expression when it is JSON, its ``repr`` (a string) otherwise, unset when there is
  none (or it is None). An exception: FAILED, PYTHON_EXCEPTION, its last line the message
  (the traceback streamed on stderr).
- ``shell``: OK for exit status 0, FAILED EXIT_STATUS (or SIGNAL) otherwise;
  ``structured_output`` is ``{exit_status, signal, session_id}``.
- The wall clock (``sandbox_wall_clock_seconds``) interrupts the call: TIMEOUT,
  WALL_CLOCK_LIMIT. A kernel that died: FAILED, SESSION_LOST (the session is closed); a
  session closed meanwhile: FAILED, SESSION_CLOSED.

Files the call left in ``$OUTPUT_DIR`` come back as sent files, as outside a session, and
are removed from the output folder (the rest of the session's folder stays as it is).

``output`` is what the call printed: stdout, then ``[stderr]`` and stderr when it wrote
any, then the value's ``repr`` (python) or the exit status (shell) in brackets.
"""

from __future__ import annotations

import asyncio
from typing import Any

from stargrpc import Outcome, ToolContext, ToolFailed, ToolResult
from stargrpc.runs.session_handle import RunSession
from stargrpc.sessions.session import CallEnd, SessionError, SessionHandle


class _CallFailed(Exception):
    """Raised inside the step so it ends with status ERROR; never leaves this module."""


async def run_in_session(ctx: ToolContext, handle: RunSession, frame: dict[str, Any], *,
                         title: str) -> ToolResult:
    """Runs one call (``frame``) in the session of ``handle`` and reports it.

    Args:
        ctx: The tool's context.
        handle: ``ctx.session``.
        frame: ``{"t": "python", "code": …}`` or ``{"t": "shell", "command": …}``.
        title: Title of the step the call runs in.

    Raises:
        ToolFailed: The session was closed or lost during the call.
        TypeError: ``handle`` is not a session's handle (:class:`SessionHandle`).
    """
    if not isinstance(handle, SessionHandle):
        raise TypeError(f"not a session's handle: {type(handle).__name__}")
    session = handle.session
    kept: dict[str, list[str]] = {"stdout": [], "stderr": []}
    end: CallEnd | None = None
    try:
        # The run holds the session's turn already (SessionHandle.hold).
        async with ctx.step(title, kind="sandbox",
                            detail={"session_id": session.session_id}) as step:

            async def on_output(channel: str, text: str) -> None:
                kept[channel].append(text)
                await step.delta(text, channel=channel)

            wall_clock = ctx.settings.sandbox_wall_clock_seconds

            async def on_tick(elapsed: float) -> None:
                await ctx.heartbeat(f"running for {elapsed:.0f} s",
                                    progress=min(elapsed / wall_clock, 1.0))

            try:
                end = await session.run(frame, on_output=on_output, on_tick=on_tick)
            except SessionError as error:
                step.summary = error.message
                raise ToolFailed(error.message, code=error.code) from error
            step.summary = _summary(end)
            ctx.usage.add_processes(cpu_user_seconds=end.cpu_user_seconds,
                                    cpu_system_seconds=end.cpu_system_seconds,
                                    peak_rss_bytes=end.peak_rss_bytes)
            if not end.ok:
                raise _CallFailed
    except _CallFailed:
        pass
    # What the call left in $OUTPUT_DIR comes back as sent files, and leaves the folder.
    sent, skipped = await asyncio.to_thread(session.take_output, session.sent_file_bytes)
    for file in sent:
        ctx.send_file(file.name, file.data, file.mime_type)
    if skipped:
        await ctx.notice("SESSION_FILES_SKIPPED", "; ".join(skipped)[:2000], warning=True)
    assert end is not None
    return _tool_result(end, frame["t"], session.session_id, kept)


def _summary(end: CallEnd) -> str:
    if end.timed_out:
        return "interrupted at the wall-clock limit"
    if end.ok:
        return "done"
    return end.error.splitlines()[-1] if end.error else "failed"


def _tool_result(end: CallEnd, kind: str, session_id: str,
                 kept: dict[str, list[str]]) -> ToolResult:
    parts = []
    stdout, stderr = "".join(kept["stdout"]), "".join(kept["stderr"])
    if stdout:
        parts.append(stdout)
    if stderr:
        parts.append("[stderr]\n" + stderr)
    structured: Any = None
    if kind == "python":
        if end.value_repr:
            parts.append(end.value_repr)
        structured = end.value if end.has_value else (end.value_repr or None)
    else:
        structured = {"exit_status": end.exit_status, "signal": end.signal,
                      "session_id": session_id}
        parts.append(f"[{end.error or 'exited with status 0'}]")
    text = "\n".join(part.rstrip("\n") for part in parts)
    if end.timed_out:
        return ToolResult(output=text, outcome=Outcome.TIMEOUT, structured=structured,
                          error_code="WALL_CLOCK_LIMIT",
                          error_message="interrupted: the call ran past the wall-clock "
                                        "limit (the session lives on)")
    if end.ok:
        return ToolResult(output=text, structured=structured)
    if kind == "python":
        code = "PYTHON_EXCEPTION"
    else:
        code = "SIGNAL" if end.signal is not None else "EXIT_STATUS"
    return ToolResult(output=text, outcome=Outcome.FAILED, structured=structured,
                      error_code=code, error_message=end.error or "the call failed")
