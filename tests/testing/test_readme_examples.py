"""The "Write a tool" page's examples run (docs/write-tools.md): every ```python block of the
page is executed in order, and every ``test_*`` function they define is run."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


PAGE = "docs/write-tools.md"


def _section_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / PAGE).read_text(), re.DOTALL)


def _examples() -> dict[str, Any]:
    # As if the blocks were a test module in tests/ (their tool path is relative to it).
    namespace: dict[str, Any] = {"__name__": "readme_write_a_tool",
                                 "__file__": str(ROOT / "tests" / "test_readme_tools.py")}
    for block in _section_blocks():
        exec(compile(block, PAGE, "exec"), namespace)
    return namespace


def test_the_section_has_the_promised_examples() -> None:
    text = "\n".join(_section_blocks())
    for needed in ("run_tool(", "serve(", "PermissionDenied", "stargrpc_server",
                   "load_tool_module(", 'code="'):
        assert needed in text, needed


EXAMPLE_TESTS = sorted(name for name, value in _examples().items()
                       if name.startswith("test_") and inspect.isfunction(value))


@pytest.mark.parametrize("name", EXAMPLE_TESTS)
async def test_readme_example(name: str, stargrpc_server: Any) -> None:
    example = _examples()[name]
    fixtures = {"stargrpc_server": stargrpc_server}
    arguments = {param: fixtures[param] for param in inspect.signature(example).parameters}
    outcome = example(**arguments)
    if inspect.isawaitable(outcome):
        await outcome


def test_the_examples_are_collected() -> None:
    assert {"test_count", "test_report", "test_lookup_fails_with_its_code",
            "test_reboot_needs_the_privileged_role", "test_count_over_grpc",
            "test_only_ops_reboot"} <= set(EXAMPLE_TESTS)
