"""python: runs a Python snippet in the sandbox and streams what it prints.

The snippet runs in a fresh interpreter (``python3 -I -u``: isolated mode, unbuffered) in
a fresh working directory, under the sandbox's limits and isolation: one the warm pool
started ahead when one is ready (the interpreter already up, given the snippet at
hand-out; see :mod:`stargrpc.sandbox.warm`), else one started for the call. Files it writes to
``$OUTPUT_DIR`` (``out/`` in its working directory) come back as sent files.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from stargrpc import ToolContext, ToolResult, tool
from stargrpc.sandbox import run_in_sandbox
from stargrpc.sandbox.warm import PYTHON_ENV, PYTHON_FLAGS


class PythonArgs(BaseModel):
    code: str = Field(min_length=1, max_length=100_000,
                      description="Python source to run; print() output streams back.")


@tool(kind="sandbox", categories=("code",), open_world=False)
async def python(ctx: ToolContext, args: PythonArgs) -> ToolResult:
    """Run a Python snippet in a sandbox and return its output and exit status.

    Files written to the folder named by the OUTPUT_DIR environment variable are returned
    as files. Steering messages sent to the run are appended, one JSON object
    {"message": ...} per line, to the file named by the STEER_FILE environment variable.
    Limits on CPU time, memory, file size, processes and wall-clock time apply.
    """
    return await run_in_sandbox(
        ctx, [ctx.settings.sandbox_python, *PYTHON_FLAGS, "snippet.py"],
        title="Running Python", files={"snippet.py": args.code}, env=dict(PYTHON_ENV))
