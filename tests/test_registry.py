"""Tool definition and loading: strict at start-up, with the file named."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from stargrpc import ToolContext, tool
from stargrpc.errors import ToolDefinitionError
from stargrpc.registry import Registry, load_directory, load_registry, spec_of

GOOD = '''
from pydantic import BaseModel, Field
from stargrpc import ToolContext, tool

class Args(BaseModel):
    """Arguments."""
    n: int = Field(description="A number.")

@tool(kind="maths", read_only=True)
async def double(ctx: ToolContext, args: Args) -> int:
    """Double a number.

    Longer text that is not part of the description.
    """
    return args.n * 2
'''


def _write(directory: Path, name: str, source: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return path


def test_tool_metadata_comes_from_name_docstring_and_model(tmp_path: Path) -> None:
    _write(tmp_path, "maths.py", GOOD)

    (spec,) = load_directory(tmp_path)

    assert spec.name == "double"
    assert spec.description == "Double a number."
    assert spec.kind == "maths"
    assert spec.annotations.read_only
    schema = spec.input_schema()
    assert schema["properties"]["n"]["type"] == "integer"
    assert schema["required"] == ["n"]


def test_module_that_fails_to_import_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken.py", "import no_such_module_anywhere\n")

    with pytest.raises(ToolDefinitionError) as caught:
        load_directory(tmp_path)

    assert str(path) in str(caught.value)
    assert "no_such_module_anywhere" in str(caught.value)


def test_bare_decorator_stops_loading_with_the_file_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "bare.py", """
        from stargrpc import tool

        @tool
        async def oops(ctx):
            return "x"
    """)

    with pytest.raises(ToolDefinitionError) as caught:
        load_directory(tmp_path)

    assert str(path) in str(caught.value)
    assert "@tool()" in str(caught.value)


def test_a_tool_too_large_to_list_stops_loading_with_the_file_named(tmp_path: Path) -> None:
    # ListTools sends the whole catalog in one message: one tool of megabytes of schema would
    # make it too large for a default client, and every caller would lose the catalog.
    path = _write(tmp_path, "huge.py", """
        from pydantic import Field, create_model
        from stargrpc import ToolContext, tool

        Huge = create_model("Huge", **{f"field_{i}": (int, Field(0, description="d" * 100))
                                       for i in range(3000)})

        @tool()
        async def huge(ctx: ToolContext, args: Huge) -> str:
            \"\"\"Take three thousand arguments.\"\"\"
            return "ok"
    """)

    with pytest.raises(ToolDefinitionError) as caught:
        load_directory(tmp_path)

    assert str(path) in str(caught.value)
    assert "tool 'huge' describes itself in" in str(caught.value)


@pytest.mark.parametrize("value", ["-1.0", "float('nan')", "'5'", "True"])
def test_a_soft_timeout_that_is_no_number_of_seconds_stops_loading(tmp_path: Path,
                                                                   value: str) -> None:
    # Taken as given, every run of the tool failed INTERNAL (NaN, a string) or was stopped
    # for no progress as it started (a negative number).
    path = _write(tmp_path, "impatient.py", f"""
        from stargrpc import ToolContext, tool

        @tool(soft_timeout={value})
        async def impatient(ctx: ToolContext) -> str:
            return "ok"
    """)

    with pytest.raises(ToolDefinitionError) as caught:
        load_directory(tmp_path)

    assert str(path) in str(caught.value)
    assert "soft_timeout" in str(caught.value) and "'impatient'" in str(caught.value)


def test_duplicate_names_across_directories_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "a", "one.py", GOOD)
    _write(tmp_path / "b", "two.py", GOOD)

    with pytest.raises(ToolDefinitionError) as caught:
        load_registry([tmp_path / "a", tmp_path / "b"], bundled=False, entry_points=False)

    message = str(caught.value)
    assert "duplicate tool name 'double'" in message
    assert "one.py" in message and "two.py" in message


def test_duplicate_of_a_bundled_tool_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "echo_again.py", """
        from pydantic import BaseModel
        from stargrpc import tool

        class A(BaseModel):
            text: str

        @tool()
        async def echo(ctx, args: A) -> str:
            return args.text
    """)

    with pytest.raises(ToolDefinitionError, match="duplicate tool name 'echo'"):
        load_registry([tmp_path], entry_points=False)


def test_arguments_parameter_must_be_a_model() -> None:
    with pytest.raises(ToolDefinitionError, match="pydantic BaseModel"):
        @tool()
        async def untyped(ctx: ToolContext, args: dict) -> str:  # type: ignore[type-arg]
            return ""


class Xs(BaseModel):
    x: int


def test_catalog_hash_is_stable_and_changes_with_any_change() -> None:
    def make(description: str) -> Registry:
        @tool(description=description)
        async def thing(ctx: ToolContext, args: Xs) -> str:
            return ""

        spec = spec_of(thing)
        assert spec is not None
        return Registry([spec])

    assert make("one").catalog_hash == make("one").catalog_hash
    assert make("one").catalog_hash != make("two").catalog_hash
    bundled_a = load_registry(entry_points=False)
    bundled_b = load_registry(entry_points=False)
    assert bundled_a.catalog_hash == bundled_b.catalog_hash
