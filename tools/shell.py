"""shell: runs a command line with ``sh -c`` in the sandbox. Privileged: the most
dangerous bundled tool, so callers need the privileged role to run it."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from stargrpc import ToolContext, ToolResult, tool
from stargrpc.sandbox import run_in_sandbox
from stargrpc.sessions.tooling import run_in_session


class ShellArgs(BaseModel):
    command: str = Field(min_length=1, max_length=20_000,
                         description="A POSIX shell command line, run with sh -c.")

    @field_validator("command")
    @classmethod
    def _no_nul(cls, command: str) -> str:
        # An argument of a program cannot hold a NUL byte: refused here, before the run,
        # rather than failing as the sandbox starts.
        if "\0" in command:
            raise ValueError("the command holds a NUL byte, which no command line can hold")
        return command


@tool(kind="sandbox", categories=("code",), privileged=True, destructive=True)
async def shell(ctx: ToolContext, args: ShellArgs) -> ToolResult:
    """Run a shell command line in a sandbox and return its output and exit status.

    Files written to $OUTPUT_DIR are returned as files. The run's own state, kept by the
    server beyond this call, is reachable with the stargrpc-state command (stargrpc-state
    set KEY JSON, get KEY, incr KEY, cas KEY EXPECTED NEW, keys, delete KEY; --scope tree
    for the call tree's). Limits on CPU time, memory, file size, processes and wall-clock
    time apply. Called in a session (session_id), the command runs in the session's folder,
    whose files persist between calls.
    """
    if ctx.session is not None:
        return await run_in_session(ctx, ctx.session, {"t": "shell", "command": args.command},
                                    title=f"$ {args.command[:80]}")
    return await run_in_sandbox(ctx, ["sh", "-c", args.command],
                                title=f"$ {args.command[:80]}")
