"""The JSON Schemas of upstream MCP tools: vetted once when a server lists its tools, then
applied to each call's arguments with bounded nesting and work.

A schema an MCP server declares is followed as told by a validator: a ``$ref`` that loops
back to itself (``{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}``), a
thousand ``allOf`` levels or a reference to a URL would recurse until the interpreter gives
up, or fetch that URL, on every call. So a schema is usable (:func:`schema_problem`) when:

- it is an object nesting at most :data:`MAX_SCHEMA_DEPTH` levels, of at most
  :data:`MAX_SCHEMA_BYTES` as the catalog carries it (a protobuf Struct);
- it speaks one dialect (``$schema`` only at the top), its ``type`` names are JSON
  Schema's and its patterns are regular expressions;
- each reference resolves inside the schema (nothing is fetched);
- no loop of subschemas applies to the same value (``$ref``, ``allOf``, ``anyOf``,
  ``oneOf``, ``not``, ``if``/``then``/``else``, ``dependentSchemas``), and no chain of them
  is longer than :data:`MAX_SCHEMA_DEPTH`. A loop through ``properties``, ``items`` and the
  like is fine: each turn moves into the arguments, whose own depth ends it.

The schema is not checked against its metaschema: jsonschema's check against 2020-12's
vocabularies costs in proportion to the subschemas, far more than the walk above (measured
in ``bench/README.md``), a server may list hundreds of schemas of 64 KiB and list them
again at will, and what the checks above leave out cannot
hang a call: an :class:`ArgumentChecker` checks arguments with :mod:`jsonschema`, each
keyword counted — deeper than :data:`MAX_EVALUATION_DEPTH` nested subschemas or more than
:data:`MAX_EVALUATION_STEPS` keywords and the arguments are refused as too costly to
check, rather than the call ending in RecursionError — and a schema the validator still
cannot apply refuses them with its reason. Either way the caller gets INVALID_ARGUMENT.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema
from google.protobuf import struct_pb2

#: Deepest nesting of objects and arrays in one schema, and longest chain of subschemas
#: applied to one value. It is also about the most a protobuf reader takes: as a Struct in
#: a ListToolsResponse each level is up to three messages deep, and readers stop at 100
#: (two levels more and a client cannot read the catalog). pydantic's schemas of deeply
#: nested models stay under 12.
MAX_SCHEMA_DEPTH = 32
#: Largest schema, in bytes of the protobuf Struct the catalog carries it as.
MAX_SCHEMA_BYTES = 64 * 1024
#: Deepest nesting of subschemas while checking one call's arguments: a recursive schema
#: (a tree) over arguments as deep as ``ArgumentLimits.max_depth`` (64) needs under 100.
#: Each level costs the validator three interpreter frames.
MAX_EVALUATION_DEPTH = 160
#: Most schema keywords evaluated while checking one call's arguments (each item of an
#: array under ``items: {"type": …}`` is one): checking runs on the event loop.
MAX_EVALUATION_STEPS = 50_000
#: Most mismatches named for one call's arguments (each becomes a field violation).
MAX_MISMATCHES = 20

# Keywords whose subschemas apply to the value itself rather than to a part of it.
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE_ONE = ("not", "if", "then", "else")
_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")
# Keywords whose subschemas apply to a part of the value (a property, an item, a key).
_INTO_MAPS = ("properties", "patternProperties")
_INTO_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames",
             "unevaluatedProperties", "unevaluatedItems", "items")
_INTO_LISTS = ("prefixItems", "items")


class SchemaTooCostly(Exception):
    """Checking arguments went past :data:`MAX_EVALUATION_DEPTH` or
    :data:`MAX_EVALUATION_STEPS`."""


class _Budget(threading.local):
    depth = 0
    steps = 0


_budget = _Budget()
_guarded_classes: dict[type[Any], type[Any]] = {}


def schema_problem(schema: Any, what: str = "input schema") -> str | None:
    """Why ``schema`` cannot be used to check arguments (a short sentence naming ``what``),
    or None when it can."""
    if not isinstance(schema, dict):
        return f"its {what} is not an object"
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        return f"its {what} nests {depth} levels (limit {MAX_SCHEMA_DEPTH})"
    size = struct_bytes(schema)
    if size > MAX_SCHEMA_BYTES:
        return f"its {what} is {size} bytes (limit {MAX_SCHEMA_BYTES})"
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        return f"its {what}'s $schema is not a string"
    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return _walk_problem(schema, base, what)


def struct_bytes(value: dict[str, Any]) -> int:
    """The size of ``value`` as a protobuf Struct (as ListTools sends a schema)."""
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct.ByteSize()


class ArgumentChecker:
    """Checks arguments against a schema :func:`schema_problem` found usable."""

    _validator: Any

    def __init__(self, schema: dict[str, Any]) -> None:
        base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        # No retrieval: a reference to a URL resolves to nothing instead of being fetched.
        self._validator = _guarded(base)(schema, registry=referencing.Registry())

    def problem(self, arguments: Any) -> str | None:
        """The first mismatch of ``arguments`` as ``path: message``, or None when they
        match.

        Raises:
            SchemaTooCostly: Checking would nest or take too long.
        """
        found = self.mismatches(arguments, limit=1)
        return str(found[0]) if found else None

    def mismatches(self, arguments: Any, limit: int = MAX_MISMATCHES) -> list[Mismatch]:
        """Where and why ``arguments`` do not match, at most ``limit``, one per field as
        local tools name them: a missing property at its own path, each unexpected one as
        an unknown field, and for ``anyOf``/``oneOf`` the most relevant branch's reason.

        Raises:
            SchemaTooCostly: Checking would nest or take too long.
        """
        _budget.depth = _budget.steps = 0
        found: dict[tuple[str | int, ...], Mismatch] = {}
        try:
            for error in self._validator.iter_errors(arguments):
                best = jsonschema.exceptions.best_match([error])
                for mismatch in _named(best if best is not None else error):
                    found.setdefault(mismatch.path, mismatch)
                if len(found) >= limit:
                    break
        except RecursionError:  # the budget makes it unreachable; kept as the last word
            raise SchemaTooCostly("nested too deeply") from None
        finally:
            _budget.depth = _budget.steps = 0
        return list(found.values())[:limit]


@dataclass(frozen=True)
class Mismatch:
    """One way arguments do not match a schema.

    Attributes:
        path: Where, from the arguments object down (keys and list indexes).
        message: Why, as the validator says it (long messages cut).
    """

    path: tuple[str | int, ...]
    message: str

    def __str__(self) -> str:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.path)
        return f"{where.lstrip('.') or 'arguments'}: {self.message}"


def _named(error: Any) -> list[Mismatch]:
    """``error`` at the path of the field it is about: a missing property's own path
    (``required``), each unexpected property's (``additionalProperties: false``)."""
    path = tuple(error.path)
    instance, schema = error.instance, error.schema
    if error.validator == "required" and isinstance(instance, dict):
        missing = [name for name in error.validator_value or ()
                   if isinstance(name, str) and name not in instance
                   and repr(name) in error.message]
        if missing:
            return [Mismatch((*path, missing[0]), "Field required")]
    if (error.validator == "additionalProperties" and error.validator_value is False
            and isinstance(instance, dict) and isinstance(schema, dict)):
        properties = schema.get("properties")
        known: dict[str, Any] = properties if isinstance(properties, dict) else {}
        pattern_map = schema.get("patternProperties")
        patterns = list(pattern_map) if isinstance(pattern_map, dict) else []
        extra = [key for key in instance if key not in known
                 and not any(re.search(pattern, key) for pattern in patterns)]
        if extra:
            return [Mismatch((*path, key), "unknown field") for key in extra]
    return [Mismatch(path, _short(error.message))]


def _guarded(base: type[Any]) -> type[Any]:
    """``base`` with every keyword counted against the budget (made once per class)."""
    guarded = _guarded_classes.get(base)
    if guarded is None:
        guarded = jsonschema.validators.extend(base, validators={
            keyword: _counted(check) for keyword, check in base.VALIDATORS.items()})
        _guarded_classes[base] = guarded
    return guarded


def _counted(check: Callable[..., Iterable[Any] | None]) -> Callable[..., Iterator[Any]]:
    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        budget = _budget
        depth = budget.depth
        budget.steps += 1
        if depth >= MAX_EVALUATION_DEPTH:
            raise SchemaTooCostly(f"more than {MAX_EVALUATION_DEPTH} nested subschemas")
        if budget.steps > MAX_EVALUATION_STEPS:
            raise SchemaTooCostly(f"more than {MAX_EVALUATION_STEPS} keywords")
        budget.depth = depth + 1
        try:
            errors = check(validator, value, instance, schema)
            if errors:
                yield from errors
        finally:
            budget.depth = depth

    return counted


def _depth(value: Any) -> int:
    """How many levels of objects and arrays ``value`` nests (iteratively)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth  # deep enough to refuse; no need to go further
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _walk_problem(schema: dict[str, Any], base: type[Any], what: str) -> str | None:
    """Goes through every subschema reachable from the top (references resolved): checks
    its own keywords, and looks for loops (and long chains) of subschemas that apply to
    the same value."""
    specification = referencing.jsonschema.specification_with(
        base.ID_OF(base.META_SCHEMA) or "", default=referencing.jsonschema.DRAFT202012)
    registry: referencing.Registry[Any] = referencing.Registry()
    root = registry.resolver_with_root(specification.create_resource(schema))
    # Each subschema reached (by identity): those applying to the same value, to a part.
    in_place: dict[int, list[int]] = {}
    into: dict[int, list[int]] = {}
    todo: list[tuple[Any, Any]] = [(schema, root)]
    seen = {id(schema)}
    while todo:
        node, resolver = todo.pop()
        same: list[int] = []
        parts: list[int] = []
        in_place[id(node)], into[id(node)] = same, parts
        if not isinstance(node, dict):
            continue  # true or false
        if node is not schema and "$schema" in node:
            return f"its {what} mixes dialects ($schema below the top)"
        own = _keyword_problem(node)
        if own:
            return f"its {what} {own}"
        children: list[tuple[Any, Any, list[int]]] = []
        for keyword in _REFERENCES:
            ref = node.get(keyword)
            if isinstance(ref, str):
                try:
                    resolved = resolver.lookup(ref)
                except referencing.exceptions.Unresolvable:
                    return f"its {what} refers to {_short(ref, 100)!r}, which it does not hold"
                children.append((resolved.contents, resolved.resolver, same))
        for keyword in _IN_PLACE_LISTS:
            children.extend((sub, None, same) for sub in _listed(node.get(keyword)))
        for keyword in _IN_PLACE_ONE:
            if keyword in node:
                children.append((node[keyword], None, same))
        for keyword in ("dependentSchemas", "dependencies"):
            children.extend((sub, None, same) for sub in _mapped(node.get(keyword)))
        for keyword in _INTO_MAPS:
            children.extend((sub, None, parts) for sub in _mapped(node.get(keyword)))
        for keyword in _INTO_ONE:
            if isinstance(node.get(keyword), dict | bool):
                children.append((node[keyword], None, parts))
        for keyword in _INTO_LISTS:
            children.extend((sub, None, parts) for sub in _listed(node.get(keyword)))
        for child, child_resolver, edges in children:
            if not isinstance(child, dict | bool):
                continue
            edges.append(id(child))
            if id(child) not in seen:
                seen.add(id(child))
                if child_resolver is None and isinstance(child, dict):
                    child_resolver = resolver.in_subresource(
                        specification.create_resource(child))
                todo.append((child, child_resolver or resolver))
    longest = _longest_chain(in_place)
    if longest is None:
        return f"its {what} has a loop of references that never moves into the arguments"
    if longest > MAX_SCHEMA_DEPTH:
        return (f"its {what} applies a chain of {longest} subschemas to one value "
                f"(limit {MAX_SCHEMA_DEPTH})")
    return None


_TYPES = frozenset(("array", "boolean", "integer", "null", "number", "object", "string"))


def _keyword_problem(node: dict[str, Any]) -> str | None:
    """What in ``node``'s own keywords would make every check fail, or None."""
    types = node.get("type")
    for name in types if isinstance(types, list) else [types] if types is not None else []:
        if not isinstance(name, str) or name not in _TYPES:
            return f"has a type that is not JSON Schema's: {_short(repr(name), 100)}"
    patterns = list(node.get("patternProperties") or ()) \
        if isinstance(node.get("patternProperties"), dict) else []
    if "pattern" in node:
        patterns.append(node["pattern"])
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError, ValueError, OverflowError, RecursionError):
            return f"has a pattern that is not a regular expression: {_short(repr(pattern), 100)}"
    return None


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _mapped(value: Any) -> list[Any]:
    return [v for v in value.values() if isinstance(v, dict | bool)] \
        if isinstance(value, dict) else []


def _longest_chain(edges: dict[int, list[int]]) -> int | None:
    """The most nodes on one path of ``edges``, or None when the graph has a loop
    (depth-first, iteratively)."""
    done: dict[int, int] = {}  # node → the longest path starting there
    for start in edges:
        if start in done:
            continue
        on_path = {start}
        stack: list[tuple[int, Iterator[int]]] = [(start, iter(edges[start]))]
        while stack:
            node, pending = stack[-1]
            child = next(pending, None)
            if child is None:
                stack.pop()
                on_path.discard(node)
                done[node] = 1 + max((done[c] for c in edges[node]), default=0)
            elif child in on_path:
                return None
            elif child not in done:
                on_path.add(child)
                stack.append((child, iter(edges.get(child, []))))
    return max(done.values(), default=0)
