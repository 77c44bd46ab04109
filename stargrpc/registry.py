"""Tools and the catalog: the ``@tool`` decorator, tool loading and the catalog hash.

A tool is a typed function ``async def fn(ctx: ToolContext, args: Model) -> ...`` (a plain
``def`` runs off the event loop). Its name comes from ``__name__``, its description from the
docstring and its input JSON Schema from the pydantic model. The decorator only attaches a
:class:`ToolSpec` to the function; :func:`load_registry` finds the specs in the tools
directories and the ``stargrpc.tools`` entry-point group, so nothing is registered as a side
effect of importing a module.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import re
import sys
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ConfigDict

from stargrpc.errors import ToolDefinitionError
from stargrpc.settings import LANE_NAME_PATTERN

#: The entry-point group third-party packages use to ship tools.
ENTRY_POINT_GROUP = "stargrpc.tools"

_SPEC_ATTRIBUTE = "__stargrpc_tool__"

#: The most a tool's description, input and output JSON Schemas may take together, as JSON.
#: ListTools sends the whole catalog in one message, which a client built with gRPC's
#: defaults refuses over 4 MiB: one tool much larger would take the catalog away from
#: every caller.
MAX_TOOL_DESCRIPTOR_BYTES = 256 * 1024


class NoArguments(BaseModel):
    """The argument model of a tool that takes no arguments."""

    # Frozen: runs without arguments share one instance (stargrpc.runs.runtime).
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class ToolAnnotations:
    """Behaviour hints shown to callers; see the contract's ToolAnnotations."""

    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False
    open_world: bool = False


@dataclass(frozen=True)
class ToolSpec:
    """Everything the server knows about one tool.

    Attributes:
        name: Unique tool name.
        description: First paragraph of the docstring, or the explicit description.
        fn: The tool function.
        args_model: Pydantic model of the arguments.
        output_model: Pydantic model of the structured output, when declared.
        kind: Short family name, also the default kind of the tool's steps.
        categories: Grouping hints for a palette.
        annotations: Behaviour hints.
        privileged: Needs an explicit privileged role to run.
        approval: Each run waits for a person's approval before it starts
            (:mod:`stargrpc.runs.approval`; ``approval_policy`` may exempt roles).
        allowed_roles: Roles allowed by the tool itself ("*" for all); configuration may
            override it.
        allowed_principals: Principal ids allowed by the tool itself, besides its roles.
        soft_timeout: Critic soft timeout for this tool in seconds, if it differs from the
            server default.
        critic: The critic that judges this tool's runs instead of the server's: a
            ``module:factory`` or ``stargrpc.critics`` entry-point name, or a Critic object.
        source: Where the tool was defined (file or entry point), for error messages.
        lane: The lane its runs wait their turn in; empty for ``default`` (``tool_lanes``
            may override it).
        default_priority: The priority of its runs when the request gives none; 0 for the
            lane's.
    """

    name: str
    description: str
    fn: Callable[..., Any]
    args_model: type[BaseModel]
    output_model: type[BaseModel] | None = None
    kind: str = ""
    categories: tuple[str, ...] = ()
    annotations: ToolAnnotations = ToolAnnotations()
    privileged: bool = False
    approval: bool = False
    allowed_roles: tuple[str, ...] = ("*",)
    allowed_principals: tuple[str, ...] = ()
    soft_timeout: float | None = None
    critic: object = None
    source: str = ""
    lane: str = ""
    default_priority: int = 0
    is_async: bool = True
    takes_args: bool = True

    def input_schema(self) -> dict[str, Any]:
        """The JSON Schema of the arguments object."""
        return self.args_model.model_json_schema()

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON Schema of the structured output, when declared."""
        return self.output_model.model_json_schema() if self.output_model else None

    def descriptor(self) -> dict[str, Any]:
        """A JSON-ready description of the tool; the catalog hash is computed over these."""
        described: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema(),
            "output_schema": self.output_schema(),
            "kind": self.kind,
            "categories": list(self.categories),
            "annotations": {
                "read_only": self.annotations.read_only,
                "destructive": self.annotations.destructive,
                "idempotent": self.annotations.idempotent,
                "open_world": self.annotations.open_world,
            },
            "privileged": self.privileged,
            "allowed_roles": list(self.allowed_roles),
        }
        if self.approval:  # absent otherwise, so existing catalog hashes stay
            described["approval"] = True
        if self.allowed_principals:  # absent otherwise, so existing catalog hashes stay
            described["allowed_principals"] = list(self.allowed_principals)
        if self.lane:  # likewise
            described["lane"] = self.lane
        if self.default_priority:
            described["default_priority"] = self.default_priority
        return described


def tool(
    bare: object = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    kind: str = "",
    categories: Iterable[str] = (),
    read_only: bool = False,
    destructive: bool = False,
    idempotent: bool = False,
    open_world: bool = False,
    privileged: bool = False,
    approval: bool = False,
    allowed_roles: Iterable[str] = ("*",),
    output_model: type[BaseModel] | None = None,
    soft_timeout: float | None = None,
    critic: object = None,
    lane: str = "",
    priority: int = 0,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Marks a function as a tool. Always call it: ``@tool()``, ``@tool(kind="demo")``.

    Args:
        name: Tool name; defaults to the function's ``__name__``.
        description: Defaults to the docstring.
        kind: Family name, and the default kind of the tool's steps.
        categories: Grouping hints for a palette.
        read_only: The tool changes nothing outside itself.
        destructive: The tool may delete or overwrite data.
        idempotent: Calling twice has the effect of calling once.
        open_world: The tool reaches systems outside the server.
        privileged: Running it needs an explicit privileged role.
        approval: Each run waits for a person's approval (ApproveRun) before it starts.
        allowed_roles: Roles allowed by default ("*" for every authenticated caller).
        output_model: Pydantic model of the structured output.
        soft_timeout: Critic soft timeout for this tool, in seconds.
        critic: The critic that judges this tool's runs instead of the server's: a
            ``module:factory`` or ``stargrpc.critics`` entry-point name, or a Critic object
            (see :mod:`stargrpc.critic`).
        lane: The lane its runs wait their turn in (``lanes`` must configure it); empty for
            ``default``.
        priority: The priority of its runs in the lane when the request gives none (0: the
            lane's ``default_priority``).

    Returns:
        A decorator that returns the function unchanged, with its spec attached.

    Raises:
        ToolDefinitionError: Used bare (``@tool`` without parentheses), or the function's
            signature is not ``(ctx, args: Model)``.
    """
    if bare is not None:
        # ``@tool`` without parentheses passes the function here. Refuse it loudly rather
        # than guess, so a typo stops start-up with the file named instead of half-working.
        raise ToolDefinitionError(
            f"{_source_of(bare)}: @tool must be called with parentheses: write @tool() above "
            f"{getattr(bare, '__name__', 'the function')}"
        )

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        args_model = _args_model_of(fn)
        doc = inspect.getdoc(fn) or ""
        spec = ToolSpec(
            name=name or fn.__name__,
            description=description if description is not None else doc.split("\n\n")[0],
            fn=fn,
            args_model=args_model,
            output_model=output_model,
            kind=kind,
            categories=tuple(categories),
            annotations=ToolAnnotations(read_only, destructive, idempotent, open_world),
            privileged=privileged,
            approval=approval,
            allowed_roles=tuple(allowed_roles),
            soft_timeout=soft_timeout,
            critic=critic,
            source=_source_of(fn),
            lane=lane,
            default_priority=priority,
            is_async=inspect.iscoroutinefunction(fn),
            takes_args=args_model is not NoArguments
            or len(inspect.signature(fn).parameters) == 2,
        )
        _check_name(spec)
        _check_size(spec)
        setattr(fn, _SPEC_ATTRIBUTE, spec)
        return fn

    return decorate


def spec_of(fn: object) -> ToolSpec | None:
    """The spec ``@tool()`` attached to ``fn``, or None."""
    spec = getattr(fn, _SPEC_ATTRIBUTE, None)
    return spec if isinstance(spec, ToolSpec) else None


def _source_of(fn: Any) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno}"
    except (TypeError, AttributeError):
        return getattr(fn, "__module__", "?")


def _check_name(spec: ToolSpec) -> None:
    if not spec.name or len(spec.name) > 64 or not all(
        c.isalnum() or c in "_-." for c in spec.name
    ):
        raise ToolDefinitionError(
            f"{spec.source}: tool name {spec.name!r} must be 1-64 letters, digits, '_', '-' or '.'"
        )
    if spec.lane and not re.match(LANE_NAME_PATTERN, spec.lane):
        raise ToolDefinitionError(f"{spec.source}: lane {spec.lane!r} of tool {spec.name!r} "
                                  "must be 1-64 letters, digits, '_', '-' or '.'")
    if not 0 <= spec.default_priority <= 1000:
        raise ToolDefinitionError(f"{spec.source}: priority {spec.default_priority} of tool "
                                  f"{spec.name!r} must be 0 to 1000")
    timeout = spec.soft_timeout
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or math.isnan(timeout) or timeout < 0):
        # Else every run of the tool failed: INTERNAL (not a number, NaN), or stopped for
        # no progress the moment it started (negative).
        raise ToolDefinitionError(f"{spec.source}: soft_timeout {timeout!r} of tool "
                                  f"{spec.name!r} must be a number of seconds (0 or none "
                                  "for the server's critic_soft_timeout)")


def _args_model_of(fn: Callable[..., Any]) -> type[BaseModel]:
    where = _source_of(fn)
    params = list(inspect.signature(fn).parameters.values())
    if not params or len(params) > 2:
        raise ToolDefinitionError(
            f"{where}: a tool takes (ctx) or (ctx, args: Model); "
            f"{getattr(fn, '__name__', '?')} takes {len(params)} parameters"
        )
    if len(params) == 1:
        return NoArguments
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an unresolvable annotation is the author's bug
        raise ToolDefinitionError(f"{where}: cannot resolve annotations: {exc}") from exc
    model = hints.get(params[1].name)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ToolDefinitionError(
            f"{where}: the arguments parameter {params[1].name!r} must be annotated with a "
            "pydantic BaseModel subclass"
        )
    return model


def _check_size(spec: ToolSpec) -> None:
    size = len(json.dumps(spec.descriptor(), separators=(",", ":")).encode())
    if size > MAX_TOOL_DESCRIPTOR_BYTES:
        raise ToolDefinitionError(
            f"{spec.source}: tool {spec.name!r} describes itself in {size} bytes (its "
            f"description and JSON Schemas); at most {MAX_TOOL_DESCRIPTOR_BYTES} are taken, "
            "or ListTools could not send the catalog")


class Registry(Mapping[str, ToolSpec]):
    """An immutable set of tools with its catalog hash."""

    _tools: dict[str, ToolSpec]
    _hash: str

    def __init__(self, specs: Iterable[ToolSpec] = ()) -> None:
        tools: dict[str, ToolSpec] = {}
        for spec in specs:
            if spec.name in tools:
                raise ToolDefinitionError(
                    f"duplicate tool name {spec.name!r}: defined in {tools[spec.name].source} "
                    f"and in {spec.source}"
                )
            tools[spec.name] = spec
        self._tools = dict(sorted(tools.items()))
        self._hash = catalog_hash(s.descriptor() for s in self._tools.values())

    def __getitem__(self, name: str) -> ToolSpec:
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def catalog_hash(self) -> str:
        """Stable digest of the catalog: same tools, same hash, in any process."""
        return self._hash


def catalog_hash(descriptors: Iterable[Mapping[str, Any]]) -> str:
    """A stable digest of tool descriptors: canonical JSON, sorted by tool name."""
    ordered = sorted(descriptors, key=lambda d: str(d["name"]))
    canonical = json.dumps(ordered, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def specs_in_module(module: ModuleType) -> list[ToolSpec]:
    """The tools defined in a module, in definition order."""
    found = []
    for value in vars(module).values():
        spec = spec_of(value)
        if spec is not None and getattr(value, "__module__", None) == module.__name__:
            found.append(spec)
    return found


def load_directory(directory: Path) -> list[ToolSpec]:
    """Imports every ``*.py`` module of ``directory`` (not ``_``-prefixed) and returns its tools.

    Raises:
        ToolDefinitionError: A module fails to import; the message names the file.
    """
    if not directory.is_dir():
        raise ToolDefinitionError(f"tools directory {directory} does not exist")
    specs: list[ToolSpec] = []
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        specs.extend(specs_in_module(_import_file(tool_module_name(path), path)))
    return specs


def tool_module_name(path: Path) -> str:
    """The name a tool module of a tools directory is imported under: unique to the
    directory, so two directories may each have a ``count.py``."""
    digest = hashlib.sha256(str(path.resolve().parent).encode()).hexdigest()[:12]
    return f"stargrpc_tools_{digest}.{path.stem}"


def import_tool_module(path: Path) -> ModuleType:
    """Imports one tool module by its path, under :func:`tool_module_name` (once: a module
    already imported from that file is returned as it is).

    Raises:
        ToolDefinitionError: It fails to import; the message names the file.
    """
    name = tool_module_name(path)
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path.resolve()):
        return loaded
    return _import_file(name, path.resolve())


def _import_file(module_name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ToolDefinitionError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except ToolDefinitionError as exc:
        sys.modules.pop(module_name, None)
        raise ToolDefinitionError(f"{path}: {exc}") from exc
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ToolDefinitionError(f"{path}: failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[ToolSpec]:
    """Tools from installed packages: each entry point names a module or a tool function."""
    specs: list[ToolSpec] = []
    for entry in importlib.metadata.entry_points(group=group):
        try:
            target = entry.load()
        except Exception as exc:
            raise ToolDefinitionError(
                f"entry point {entry.name} = {entry.value}: failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(target, ModuleType):
            specs.extend(specs_in_module(target))
        elif (spec := spec_of(target)) is not None:
            specs.append(spec)
        else:
            raise ToolDefinitionError(
                f"entry point {entry.name} = {entry.value}: neither a module nor a @tool() function"
            )
    return specs


def bundled_tools_dir() -> Path:
    """The bundled tools: the repository's ``tools/`` in a checkout, or the wheel's copy."""
    package = Path(__file__).resolve().parent
    checkout = package.parent / "tools"
    if checkout.is_dir() and (package.parent / "pyproject.toml").is_file():
        return checkout
    return package / "_bundled_tools"


def load_registry(tools_dirs: Iterable[Path] = (), *, bundled: bool = True,
                  entry_points: bool = True) -> Registry:
    """Loads the catalog: bundled tools, extra directories, then entry points.

    Raises:
        ToolDefinitionError: A broken module or a duplicate tool name, named in the message.
    """
    specs: list[ToolSpec] = []
    dirs = [bundled_tools_dir()] if bundled else []
    seen: set[Path] = set()
    for directory in [*dirs, *tools_dirs]:
        resolved = Path(directory).resolve()
        if resolved in seen:
            continue
        seen.add(resolved)
        specs.extend(load_directory(resolved))
    if entry_points:
        specs.extend(load_entry_points())
    return Registry(specs)
