"""One conformance suite, three languages: the Python, Node and Go runners each run every
case of conformance/cases.json against one live server (authentication on, the tools of
conformance/tools loaded), and each must print the same case names, all PASS."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.client_builds import NODE_DIR, build_go
from tests.conftest import AuthServerFactory

REPO = Path(__file__).resolve().parent.parent
CASES = REPO / "conformance" / "cases.json"
TIMEOUT = 300


@pytest.fixture(scope="session")
def runners(tmp_path_factory: pytest.TempPathFactory,
            node_cli: list[str]) -> dict[str, list[str]]:
    """The command of each runner, built or installed as needed."""
    node = node_cli[0]
    go = build_go("stargrpc-conformance", tmp_path_factory.mktemp("conformance"))
    return {
        "python": [sys.executable, "-m", "stargrpc.client.conformance", "--cases", str(CASES)],
        "node": [node, str(NODE_DIR / "conformance.js"), "--cases", str(CASES)],
        "go": [go, "-cases", str(CASES)],
    }


async def _run(command: list[str], target: str, key: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *command, "--target" if command[-2] == "--cases" else "-target", target,
        "--api-key" if command[-2] == "--cases" else "-api-key", key,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_python_node_and_go_pass_the_same_conformance_cases(
        make_auth_server: AuthServerFactory, runners: dict[str, list[str]]) -> None:
    auth = await make_auth_server(tools_dir=[REPO / "conformance" / "tools"])
    names = [case["name"] for case in json.loads(CASES.read_text())["cases"]]

    ran = await asyncio.gather(*(_run(command, auth.target, auth.key)
                                 for command in runners.values()))

    for language, (code, out) in zip(runners, ran, strict=True):
        lines = out.splitlines()
        assert lines == [f"PASS {name}" for name in names] + [f"{len(names)} passed, 0 failed"], \
            f"{language}:\n{out}"
        assert code == 0, language


async def test_a_runner_reports_a_failing_case_and_exits_non_zero(
        make_auth_server: AuthServerFactory, runners: dict[str, list[str]],
        tmp_path: Path) -> None:
    # The same cases against a server without the conformance tools: the runners must say
    # so case by case, keep going, and fail.
    auth = await make_auth_server()
    cases = json.loads(CASES.read_text())["cases"]
    one = tmp_path / "cases.json"
    one.write_text(json.dumps({"cases": [cases[0], {"name": "no_such_case"}]}))

    ran = await asyncio.gather(*(_run([*command[:-1], str(one)], auth.target, auth.key)
                                 for command in runners.values()))

    for language, (code, out) in zip(runners, ran, strict=True):
        lines = out.splitlines()
        assert lines[0].startswith(f"FAIL {cases[0]['name']}: "), f"{language}:\n{out}"
        assert "NOT_FOUND" in lines[0] or "TOOL_NOT_FOUND" in lines[0], f"{language}:\n{out}"
        assert lines[1] == "FAIL no_such_case: not implemented by this runner", language
        assert lines[2:] == ["0 passed, 2 failed"] and code == 1, f"{language}:\n{out}"
