"""A tools directory imports cleanly in tests with ``load_tool_module``."""

from __future__ import annotations

from pathlib import Path

import pytest

from stargrpc.errors import ToolDefinitionError
from stargrpc.registry import load_directory
from stargrpc.testing import load_tool_module, run_tool

TOOLS = Path(__file__).parents[2] / "tools"


async def test_a_tool_module_loads_by_path_as_the_server_loads_it() -> None:
    module = load_tool_module(TOOLS / "count.py")

    assert load_tool_module(str(TOOLS / "count.py")) is module  # imported once
    # Under the name the server's loader gives it.
    [spec] = [s for s in load_directory(TOOLS) if s.name == "count"]
    recorded = await run_tool(module.count, {"to": 2})
    assert recorded.deltas == "1\n2\n"
    assert spec.fn.__module__ == module.__name__


def test_a_broken_tool_module_names_its_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(ToolDefinitionError, match=r"broken\.py"):
        load_tool_module(broken)
