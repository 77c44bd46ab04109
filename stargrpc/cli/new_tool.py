"""``stargrpc new-tool NAME``: scaffold a tool and its test.

Writes ``<tools-dir>/NAME.py`` (a typed async tool with a step and a delta) and
``<tools-dir>/../tests/test_NAME.py``, which imports the tool by its path with
:func:`stargrpc.testing.load_tool_module` (so it runs from any directory, the tools
directory needing no ``__init__.py``) and runs it with :func:`stargrpc.testing.run_tool`.
Existing files are never overwritten.
"""

from __future__ import annotations

import keyword
from pathlib import Path

import click

TOOL_TEMPLATE = '''\
"""{name}: describe what it does in one line."""

from __future__ import annotations

from pydantic import BaseModel, Field

from stargrpc import ToolContext, ToolFailed, tool


class {model}(BaseModel):
    text: str = Field(min_length=1, description="What to work on.")


@tool()
async def {name}(ctx: ToolContext, args: {model}) -> str:
    """Say what the tool does: this line is its description in the catalog."""
    async with ctx.step("Working") as step:
        await step.delta(f"working on {{args.text}}\\n")
    if args.text == "fail":
        raise ToolFailed("cannot work on 'fail'", code="NOT_WORKABLE")
    return f"done: {{args.text}}"
'''

TEST_TEMPLATE = '''\
"""Tests of the {name} tool."""

from __future__ import annotations

from pathlib import Path

from stargrpc import Outcome
from stargrpc.testing import load_tool_module, run_tool_sync

{name} = load_tool_module(Path(__file__).parents[1] / "{tools_dir}" / "{name}.py").{name}


def test_{name}_works() -> None:
    recorded = run_tool_sync({name}, {{"text": "hello"}})

    assert recorded.outcome is Outcome.OK
    assert recorded.output == "done: hello"
    assert recorded.steps.outline() == ["{name}", [["Working", []]]]
    assert recorded.deltas == "working on hello\\n"


def test_{name}_fails_with_its_code() -> None:
    recorded = run_tool_sync({name}, {{"text": "fail"}})

    assert recorded.outcome is Outcome.FAILED
    assert recorded.error_code == "NOT_WORKABLE"
'''


def _check_name(name: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name) or name != name.lower() \
            or name.startswith("_"):
        raise click.BadParameter(
            f"{name!r}: a tool name is a lowercase Python identifier such as word_count "
            "(not a keyword, not starting with _)", param_hint="NAME")


@click.command("new-tool")
@click.argument("name")
@click.option("--tools-dir", type=click.Path(path_type=Path, file_okay=False),
              default=Path("tools"), show_default=True,
              help="The tools directory; the test goes to tests/ beside it.")
def new_tool(name: str, tools_dir: Path) -> None:
    """Scaffold a tool NAME and its test (never overwrites a file)."""
    _check_name(name)
    tool_file = tools_dir / f"{name}.py"
    test_file = tools_dir.parent / "tests" / f"test_{name}.py"
    existing = [str(path) for path in (tool_file, test_file) if path.exists()]
    if existing:
        raise click.ClickException(f"not overwriting {', '.join(existing)}")
    model = "".join(part.capitalize() for part in name.split("_")) + "Args"
    tool_file.parent.mkdir(parents=True, exist_ok=True)
    test_file.parent.mkdir(parents=True, exist_ok=True)
    tool_file.write_text(TOOL_TEMPLATE.format(name=name, model=model))
    test_file.write_text(TEST_TEMPLATE.format(name=name, tools_dir=tools_dir.resolve().name))
    click.echo(f"created {tool_file}")
    click.echo(f"created {test_file}")
    click.echo(f"test it: pytest {test_file}")
