"""The contract as other languages see it: every code the server can send is a value of
the ErrorReason enum, the protos declare the options each language's generator needs, and
reflection serves the descriptors with their comments (grpcurl describe explains a field).
"""

from __future__ import annotations

import ast
import asyncio
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stargrpc.errors import ToolDenied, ToolFailed
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.v1 import errors_pb2

ROOT = Path(__file__).resolve().parent.parent
GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")

#: What a stable code looks like.
_CODE = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)*")
#: Keyword arguments (and assignments) that carry a code: ErrorInfo/RequestError ``reason``,
#: ToolFailed and ToolDenied ``code``, ToolResult ``error_code``, an error class's
#: ``default_code``.
_CODE_KEYWORDS = frozenset({"reason", "code", "error_code", "default_code"})
#: Calls whose positional string arguments include a code: a sandbox Verdict, an http_fetch
#: Refused, Run.stop(outcome, code, message), the supervision's _stop(code, message) and
#: _notice(code, message), Run.emit_notice(code, message), a tool's ctx.notice(code, message).
_CODE_CALLS = frozenset({"Verdict", "Refused", "stop", "_stop", "emit_notice", "_notice",
                         "notice"})
#: A code that is not an error: the sandbox's verdict on a command that succeeded.
_NOT_ERRORS = frozenset({"OK"})


def _sources() -> Iterator[Path]:
    for folder in (ROOT / "stargrpc", ROOT / "tools"):
        for path in sorted(folder.rglob("*.py")):
            if "v1" not in path.relative_to(folder).parts[:1]:
                yield path


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _codes_in(tree: ast.Module) -> Iterator[str]:
    """The codes a module sends, found by where they are passed, not by their spelling."""
    constants = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)}
    values: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            values.extend(k.value for k in node.keywords if k.arg in _CODE_KEYWORDS)
            if _name(node.func) in _CODE_CALLS:
                values.extend(node.args)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_name(t) in _CODE_KEYWORDS for t in targets):
                values.append(node.value)
    for value in values:
        if isinstance(value, ast.Name) and value.id in constants:  # a module constant
            value = constants[value.id]
        if (isinstance(value, ast.Call) and _name(value.func) == "reason_name"
                and isinstance(value.args[0], ast.Attribute)):
            text = value.args[0].attr  # reason_name(errors_pb2.X): X, checked at import
        elif isinstance(value, ast.Constant) and isinstance(value.value, str):
            text = value.value
        else:
            continue
        if _CODE.fullmatch(text) and text not in _NOT_ERRORS:
            yield text


def emitted_codes() -> dict[str, set[str]]:
    """Every code the package and the bundled tools can send, with where it is found."""
    found: dict[str, set[str]] = {}
    for path in _sources():
        for code in _codes_in(ast.parse(path.read_text(), str(path))):
            found.setdefault(code, set()).add(str(path.relative_to(ROOT)))
    for raised in (ToolFailed("x"), ToolDenied("x")):  # their default code is computed
        found.setdefault(raised.code, set()).add("stargrpc/errors.py")
    return found


def test_every_code_the_server_can_send_is_an_error_reason() -> None:
    reasons = set(errors_pb2.ErrorReason.keys())
    found = emitted_codes()

    missing = {code: sorted(where) for code, where in found.items() if code not in reasons}
    assert not missing, f"add these to ErrorReason in protos/stargrpc/v1/errors.proto: {missing}"
    # The collector does find the codes it must (it would pass vacuously otherwise).
    assert {"CATALOG_STALE", "RUN_NOT_FOUND", "RUN_FINISHED", "CRITIC_NO_PROGRESS",
            "CLIENT_DEADLINE", "SANDBOX_UNAVAILABLE", "RUN_LOST", "TOOL_FAILED",
            "WALL_CLOCK_LIMIT", "HOST_NOT_ALLOWED"} <= set(found)


def test_error_reason_names_are_the_strings_sent() -> None:
    values = errors_pb2.ErrorReason.DESCRIPTOR.values
    names = [value.name for value in values]

    assert names[0] == "ERROR_REASON_UNSPECIFIED" and values[0].number == 0
    assert all(_CODE.fullmatch(name) for name in names)
    assert len(set(names)) == len(names) == len({value.number for value in values})
    # Codes other helpers are adding, declared ahead so every language has them.
    assert {"DISK_LIMIT", "SANDBOX_UNAVAILABLE", "OUTPUT_TRUNCATED", "RESULT_TOO_LARGE",
            "RUN_FINISHED", "RUN_LOST", "STORE_CONFLICT"} <= set(names)


def test_every_proto_declares_the_options_of_each_language() -> None:
    for proto in sorted((ROOT / "protos" / "stargrpc" / "v1").glob("*.proto")):
        text = proto.read_text()
        options = dict(re.findall(r'^option (\w+) = "?(.*?)"?;$', text, re.M))
        stem = "".join(part.title() for part in proto.stem.split("_"))

        assert options == {
            "csharp_namespace": "Stargrpc.V1",
            "go_package": "github.com/stargrpc/stargrpc/clients/go/stargrpcv1;stargrpcv1",
            "java_multiple_files": "true",
            "java_outer_classname": f"{stem}Proto",
            "java_package": "dev.stargrpc.v1",
            "objc_class_prefix": "SXX",
            "php_namespace": "Stargrpc\\\\V1",
            "ruby_package": "Stargrpc::V1",
        }, proto.name


async def _grpcurl(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        GRPCURL, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize(("symbol", "explained"), [
    ("stargrpc.v1.WatchRunRequest", "Replay events with a seq greater than this"),
    ("stargrpc.v1.ToolService", "nothing follows: OUT_OF_RANGE"),
    ("stargrpc.v1.ErrorReason", "reload with ListTools and"),
    ("stargrpc.v1.RunEvent", "Position in the run's event log"),
])
async def test_grpcurl_describe_shows_the_comments_of_the_contract(
        server: StargrpcServer, symbol: str, explained: str) -> None:
    code, out, err = await _grpcurl("-plaintext", f"127.0.0.1:{server.port}", "describe",
                                    symbol)

    assert code == 0, err
    assert explained in out
