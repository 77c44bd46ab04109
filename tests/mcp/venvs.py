"""Commands for the agent apps tested in virtual environments of their own (stacks the
suite's venv cannot hold beside its own: langchain-mcp-adapters with mcp 1, FastMCP 4.2)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

#: The longest line a script may print (a JSON line of everything it saw).
MAX_LINE_BYTES = 1 << 20


async def run_command(cwd: Path, *argv: str,
                      on_line: Callable[[str], None] | None = None) -> str:
    """Runs ``argv`` in ``cwd`` (not the repository: there ``import stargrpc`` would find
    the source instead of what the venv installed) without the suite's ``VIRTUAL_ENV`` and
    ``PYTHONPATH``, handing each line of its output to ``on_line`` as it comes.

    Returns:
        Its output (stdout and stderr).

    Raises:
        AssertionError: it exited with another status than 0 (with the end of its output).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        cwd=cwd, limit=MAX_LINE_BYTES)
    assert process.stdout is not None
    lines = []
    while line := (await process.stdout.readline()).decode(errors="replace"):
        lines.append(line)
        if on_line is not None:
            on_line(line)
    text = "".join(lines)
    returncode = await process.wait()
    assert returncode == 0, f"{argv[:4]} failed ({returncode}):\n{text[-4000:]}"
    return text
