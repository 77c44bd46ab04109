"""Isolation policy: weak isolation fails closed, root is refused as the sandbox user, a
downgrade says why, and sandbox_isolation_min is a floor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from stargrpc.cli.doctor import build_report
from stargrpc.sandbox import decide
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, run_tool
from tests.procs import ImageUser, serve

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switches users (needs root)")
needs_bwrap = pytest.mark.skipif(
    decide(Settings.load()).isolation is None
    or decide(Settings.load()).isolation.mode != "bwrap",  # type: ignore[union-attr]
    reason="bubblewrap isolation is not available on this machine")


def result_of(events: list[events_pb2.RunEvent]) -> events_pb2.Result:
    assert events[-1].HasField("result")
    return events[-1].result


def locked_sandbox_root(tmp_path: Path) -> Path:
    """A sandbox root below a folder only root may enter (nobody cannot reach it)."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    return locked / "sandbox"


# -- root as the sandbox user ---------------------------------------------------------------

@pytest.mark.parametrize("user", ["root"])
def test_root_as_sandbox_user_is_refused(user: str) -> None:
    with pytest.raises(ValidationError, match="sandbox_user 'root' is root"):
        Settings.load(sandbox_user=user)


def test_serve_refuses_root_as_sandbox_user_at_start(tmp_path: Path) -> None:
    env = {**os.environ, "STARGRPC_STATE_DIR": str(tmp_path), "STARGRPC_SANDBOX_USER": "root"}
    done = subprocess.run([sys.executable, "-m", "stargrpc.cli", "serve", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "sandbox_user 'root' is root" in done.stderr
    assert "name an unprivileged user" in done.stderr


def test_isolation_below_its_own_minimum_is_a_settings_error() -> None:
    with pytest.raises(ValidationError, match="weaker than sandbox_isolation_min"):
        Settings.load(sandbox_isolation="rlimits", sandbox_isolation_min="bwrap")


# -- downgrade and minimum (the server here is root, with bubblewrap) ------------------------

@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The server's PATH without bubblewrap; returns a fresh sandbox root nobody can reach
    (a new one, so the probe is not answered from another test's cache)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("prlimit", "setpriv", "unshare"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))
    root = Path(tempfile.mkdtemp(prefix="stargrpc-policy-"))
    yield root  # type: ignore[misc]
    shutil.rmtree(root, ignore_errors=True)


@needs_root
def test_a_refusal_names_its_fix_which_the_doctor_lists(no_bwrap: Path, tmp_path: Path
                                                        ) -> None:
    settings = Settings.load(state_dir=tmp_path / "state", sandbox_root=no_bwrap,
                             sandbox_isolation_min="bwrap")
    policy = decide(settings)

    assert policy.refusal is not None and policy.fix is not None
    assert "install bubblewrap" in policy.fix
    assert policy.refusal.endswith(f"; fix: {policy.fix}")
    assert policy.fix in build_report(settings)["fixes"]


@needs_root
@needs_bwrap
async def test_downgrade_from_bwrap_is_a_warning_with_the_reason(make_server,
                                                                 no_bwrap: Path) -> None:
    with capture_logs() as logs:
        server = await make_server(sandbox_root=no_bwrap)
    downgrades = [line for line in logs if line["event"] == "sandbox_isolation_downgraded"]
    assert len(downgrades) == 1
    assert downgrades[0]["log_level"] == "warning"
    assert downgrades[0]["mode"] == "unshare"
    assert downgrades[0]["reasons"] == {
        "bwrap": "bwrap is not installed (not on the server's PATH)"}

    # The state folder is out of nobody's reach, so unshare may run the tools.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        result = result_of(await run_tool(stub, "python", {"code": "print(6*7)"}))
    assert result.outcome == events_pb2.OUTCOME_OK, result.error
    assert as_dict(result)["structured_output"]["isolation"] == "unshare"


@needs_root
@needs_bwrap
async def test_isolation_min_bwrap_refuses_when_only_unshare_works(make_server,
                                                                 no_bwrap: Path) -> None:
    server = await make_server(sandbox_root=no_bwrap, sandbox_isolation_min="bwrap")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        for tool, arguments in (("python", {"code": "print(1)"}), ("shell", {"command": "id"})):
            result = result_of(await run_tool(stub, tool, arguments))
            assert result.outcome == events_pb2.OUTCOME_FAILED
            assert result.error.code == "SANDBOX_UNAVAILABLE"
            assert "isolation unshare is weaker than sandbox_isolation_min=bwrap" \
                in result.error.message
            assert "install bubblewrap" in result.error.message
        # Still serving.
        assert result_of(await run_tool(stub, "echo", {"text": "hi"})).output == "hi"


@needs_root
async def test_sandbox_root_the_sandbox_user_cannot_reach_is_refused_with_the_reason(
        make_server, tmp_path: Path) -> None:
    """Every mode hands the command paths in its working directory, so no mode works (a
    run in unshare would fail with "can't open file"): refused, naming the folder."""
    root = locked_sandbox_root(tmp_path)
    with capture_logs() as logs:
        server = await make_server(sandbox_root=root)
    [unavailable] = [line for line in logs if line["event"] == "sandbox_unavailable"]
    assert unavailable["tools"] == ["python", "shell"]
    assert f"sandbox_root {root} cannot be reached by the sandbox user" in unavailable["error"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        result = result_of(await run_tool(stub, "python", {"code": "print(1)"}))
    assert result.error.code == "SANDBOX_UNAVAILABLE"
    assert "is mode 0700 owned by uid 0; make every parent folder searchable" \
        in result.error.message


@needs_root
@needs_bwrap
async def test_unshare_with_secrets_readable_by_the_sandbox_user_fails_closed(
        make_server, no_bwrap: Path) -> None:
    open_state = Path(os.environ.get("TMPDIR", "/tmp")) / f"stargrpc-open-{os.getpid()}"
    open_state.mkdir(mode=0o755, exist_ok=True)
    open_state.chmod(0o755)
    try:
        keys = open_state / "keys.json"
        keys.write_text('{"keys": []}')
        keys.chmod(0o644)
        with capture_logs() as logs:
            server = await make_server(sandbox_root=no_bwrap, state_dir=open_state)
        disabled = [line for line in logs if line["event"] == "sandbox_tools_disabled"]
        assert disabled and disabled[0]["tools"] == ["python", "shell"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            result = result_of(await run_tool(stub, "python", {"code": "print(1)"}))
        assert result.error.code == "SANDBOX_UNAVAILABLE"
        assert (f"the keys file {keys} is readable by a user of its own per run"
                in result.error.message)
        assert "sandbox_allow_weak_isolation=true" in result.error.message
    finally:
        for child in open_state.iterdir():
            child.unlink()
        open_state.rmdir()


# -- the image: a non-root server without bubblewrap ----------------------------------------

def call(target: str, tool: str, arguments: dict[str, object]) -> events_pb2.Result:
    with grpc.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        request = tool_service_pb2.ExecuteRequest(tool_name=tool,
                                                  arguments_json=json.dumps(arguments))
        events = [response.event for response in stub.Execute(request, timeout=60)]
    return result_of(events)


def test_image_refuses_sandboxed_tools_by_default(image: ImageUser) -> None:
    with serve(image.state_dir, prefix=image.prefix, **image.env) as server:
        disabled = server.wait_for(lambda line: line.get("event") == "sandbox_tools_disabled",
                                   30)
        assert disabled["level"] == "warning"
        assert disabled["tools"] == ["python", "shell"]
        assert "bwrap is not installed" in str(disabled["reason"])
        for tool, arguments in (("python", {"code": "print(open('/proc/1/environ').read())"}),
                                ("shell", {"command": "cat ../../state/keys.json"})):
            result = call(server.target, tool, arguments)
            assert result.outcome == events_pb2.OUTCOME_FAILED
            assert result.error.code == "SANDBOX_UNAVAILABLE"
            assert "isolation rlimits cannot keep a run away from the server's secrets" \
                in result.error.message
            assert "install bubblewrap" in result.error.message
        with grpc.insecure_channel(server.target) as channel:
            listed = tool_service_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_service_pb2.ListToolsRequest(), timeout=10)
        kinds = {tool.name: tool.kind for tool in listed.tools}
        assert kinds["python"] == kinds["shell"] == "sandbox"
        assert call(server.target, "echo", {"text": "still serving"}).output == "still serving"


@pytest.mark.parametrize("opt_in", [{"STARGRPC_SANDBOX_ALLOW_WEAK_ISOLATION": "true"},
                                    {"STARGRPC_SANDBOX_ISOLATION": "rlimits"}])
def test_image_runs_sandboxed_tools_on_explicit_opt_in_with_a_warning(
        image: ImageUser, opt_in: dict[str, str]) -> None:
    with serve(image.state_dir, prefix=image.prefix, **image.env, **opt_in) as server:
        weak = server.wait_for(lambda line: line.get("event") == "sandbox_weak_isolation", 30)
        assert weak["level"] == "warning"
        assert weak["tools"] == ["python", "shell"]
        name, value = next(iter(opt_in.items()))
        assert weak["allowed_by"] == f"{name.removeprefix('STARGRPC_').lower()}={value}"
        result = call(server.target, "python", {"code": "import os; print(os.getuid())"})
        assert result.outcome == events_pb2.OUTCOME_OK, result.error
        assert result.output.startswith("10001")
        assert as_dict(result)["structured_output"]["isolation"] == "rlimits"
