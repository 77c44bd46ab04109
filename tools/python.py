"""python: runs a Python snippet in the sandbox and streams what it prints.

Outside a session the snippet runs in a fresh interpreter (``python3 -s -u``: no user
site-packages, unbuffered) in a fresh working directory, under the sandbox's limits and
isolation: one the warm pool started ahead when one is ready (the interpreter already up,
given the snippet at hand-out; see :mod:`stargrpc.sandbox.warm`), else one started for the
call. Files it writes to ``$OUTPUT_DIR`` (``out/`` in its working directory) come back as
sent files. In a session (``ExecuteRequest.session_id``) it runs in the session's live
interpreter instead (:mod:`stargrpc.sessions`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from stargrpc import ToolContext, ToolResult, tool
from stargrpc.sandbox import run_in_sandbox
from stargrpc.sandbox.warm import PYTHON_ENV, PYTHON_FLAGS
from stargrpc.sessions.tooling import run_in_session


class PythonArgs(BaseModel):
    code: str = Field(min_length=1, max_length=100_000,
                      description="Python source to run; print() output streams back.")


@tool(kind="sandbox", categories=("code",), open_world=False)
async def python(ctx: ToolContext, args: PythonArgs) -> ToolResult:
    """Run a Python snippet in a sandbox and return its output and exit status.

    Files written to the folder named by the OUTPUT_DIR environment variable are returned
    as files. Steering messages sent to the run are appended, one JSON object
    {"message": ...} per line, to the file named by the STEER_FILE environment variable.
    The run's own state, kept by the server beyond this call, is reachable from the
    snippet: import stargrpc_state; stargrpc_state.state("run").set("k", value) (or "tree",
    shared by a call tree), then get, increment, compare_and_set, keys and delete.
    Limits on CPU time, memory, file size, processes and wall-clock time apply.
    Called in a session (session_id), the code runs in the session's live interpreter:
    imports, variables and files persist between calls, and the value of a final
    expression comes back as the structured output.
    """
    if ctx.session is not None:
        return await run_in_session(ctx, ctx.session, {"t": "python", "code": args.code},
                                    title="Running Python in the session")
    # -s -u rather than -I: the environment is the server's own (scrubbed) and must be
    # read, for PYTHONPATH holds the run's state client (import stargrpc_state).
    return await run_in_sandbox(
        ctx, [ctx.settings.sandbox_python, *PYTHON_FLAGS, "snippet.py"],
        title="Running Python", files={"snippet.py": args.code}, env=dict(PYTHON_ENV))
