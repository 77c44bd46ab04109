"""Upstream tools' schemas (stargrpc.mcp.schemas): which are usable, and checking arguments
with bounded nesting and work."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError

from stargrpc.mcp import schemas
from stargrpc.mcp.schemas import ArgumentChecker, SchemaTooCostly, schema_problem
from stargrpc.v1 import catalog_pb2, tool_service_pb2
from tests.mcp.upstream_server import SELF_REFERENCING, TREE


def nesting(levels: int) -> dict[str, Any]:
    """A schema ``levels`` objects deep (its default value nests)."""
    value: dict[str, Any] = {"end": True}
    for _ in range(levels - 2):
        value = {"a": value}
    return {"type": "object", "default": value}


def read_back(schema: dict[str, Any]) -> None:
    """Sends ``schema`` in a ListToolsResponse and reads it as a client does."""
    tool = catalog_pb2.Tool(name="t")
    tool.input_schema.update(schema)
    data = tool_service_pb2.ListToolsResponse(tools=[tool]).SerializeToString()
    tool_service_pb2.ListToolsResponse.FromString(data)


def test_the_deepest_schema_allowed_is_about_the_deepest_a_client_can_read() -> None:
    deepest = nesting(schemas.MAX_SCHEMA_DEPTH)
    assert schema_problem(deepest) is None
    read_back(deepest)
    assert "nests 33 levels (limit 32)" in (
        schema_problem(nesting(schemas.MAX_SCHEMA_DEPTH + 1)) or "")
    with pytest.raises(DecodeError):  # protobuf readers stop at 100 messages deep
        read_back(nesting(schemas.MAX_SCHEMA_DEPTH + 2))


@pytest.mark.parametrize(("schema", "reason"), [
    (SELF_REFERENCING, "has a loop of references that never moves into the arguments"),
    ({"type": "object", "allOf": [{"$ref": "#/$defs/b"}],
      "$defs": {"b": {"anyOf": [{"$ref": "#"}]}}}, "has a loop of references"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/a",
      "definitions": {"a": {"$ref": "#/definitions/a"}}}, "has a loop of references"),
    ({"type": "object", "$ref": "#/$defs/a0",
      "$defs": {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(40)} | {"a40": {}}},
     "applies a chain of 42 subschemas to one value (limit 32)"),
    ({"$ref": "https://example.com/schema.json"}, "which it does not hold"),
    ({"$ref": "#/$defs/missing"}, "which it does not hold"),
    ({"properties": {"a": {"pattern": "("}}}, "has a pattern that is not a regular expression"),
    ({"patternProperties": {"[": {}}}, "has a pattern that is not a regular expression: '['"),
    ({"properties": {"a": {"type": ["string", "text"]}}},
     "has a type that is not JSON Schema's: 'text'"),
    ({"type": "object", "properties": {"a": {"$schema": "http://json-schema.org/draft-04/schema#"}}},
     "mixes dialects"),
    ({"$schema": {"not": "a string"}}, "$schema is not a string"),
    ([], "is not an object"),
    ({"enum": ["x" * 70_000]}, "bytes (limit 65536)"),
])
def test_an_unusable_schema_is_named_for_what_it_does(schema: Any, reason: str) -> None:
    problem = schema_problem(schema)
    assert problem is not None and reason in problem, problem


def test_a_recursive_schema_checks_deep_but_finite_arguments() -> None:
    assert schema_problem(TREE) is None
    checker = ArgumentChecker(TREE)
    tree: dict[str, Any] = {}
    for _ in range(31):
        tree = {"children": [tree]}
    assert checker.problem(tree) is None
    tree["children"].append({"children": "no"})
    assert checker.problem(tree) == "children[1].children: 'no' is not of type 'array'"


def test_checking_is_bounded_in_depth_and_in_work() -> None:
    chain: dict[str, Any] = {f"n{i}": {"$ref": f"#/$defs/n{i + 1}"} for i in range(30)}
    chain["n30"] = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n0"}}}
    schema = {"type": "object", "$ref": "#/$defs/n0", "$defs": chain}
    assert schema_problem(schema) is None
    nested: dict[str, Any] = {}
    for _ in range(40):
        nested = {"x": nested}
    with pytest.raises(SchemaTooCostly, match="nested subschemas"):
        ArgumentChecker(schema).problem(nested)
    many = ArgumentChecker({"type": "array", "items": {"type": "integer"}})
    assert many.problem(list(range(1000))) is None
    with pytest.raises(SchemaTooCostly, match="keywords"):
        many.problem(list(range(schemas.MAX_EVALUATION_STEPS + 1)))
    assert many.problem([1, "two"]) == "[1]: 'two' is not of type 'integer'"  # budget reset


def test_a_reference_to_a_url_is_never_fetched() -> None:
    # Even were it handed a schema that refers elsewhere, the checker resolves nothing.
    checker = ArgumentChecker({"properties": {"a": {"$ref": "http://127.0.0.1:9/x.json"}}})
    with pytest.raises(Exception, match="Unresolvable"):
        checker.problem({"a": 1})


def test_mismatches_name_each_field_at_its_path_as_local_tools_do() -> None:
    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "integer"},
                             "b": {"type": "object", "required": ["c"],
                                   "additionalProperties": False,
                                   "properties": {"c": {"type": "string"}}},
                             "d": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
    checker = ArgumentChecker(schema)
    assert [str(m) for m in checker.mismatches({"a": "two"})] == [
        "a: 'two' is not of type 'integer'"]
    found = checker.mismatches({"b": {"x": 1}, "d": "no"})
    assert {(m.path, m.message) for m in found} == {
        (("a",), "Field required"), (("b", "c"), "Field required"),
        (("b", "x"), "unknown field"), (("d",), "'no' is not valid under any of the given schemas")}
    assert checker.mismatches({"a": 1}) == []
