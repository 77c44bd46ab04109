"""``stargrpc doctor``: the isolation it would pick, disabled tools, reachable secrets, the
fixes, and an exit status that says whether sandboxed tools would run weakly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ImageUser

SECRET = "an-env-secret-that-is-long-enough-for-hs256-42"


def doctor(*args: str, env: dict[str, str], prefix: Sequence[str] = ()
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "stargrpc.cli", "doctor", *args],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=False)


def report(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.stdout, f"no report; exit status {done.returncode}; stderr: {done.stderr}"
    data: dict[str, Any] = json.loads(done.stdout)
    assert data["exit_status"] == done.returncode, done.stderr
    return data


def test_image_defaults_report_disabled_tools_reachable_secrets_and_fixes(
        image: ImageUser) -> None:
    env = {**image.env, "STARGRPC_JWT_SECRET": SECRET, "STARGRPC_JWT_ISSUER": "i",
           "STARGRPC_JWT_AUDIENCE": "a"}
    done = doctor("--json", env=env, prefix=image.prefix)
    assert done.returncode == 3
    found = report(done)
    assert found["isolation"]["mode"] == "rlimits"
    assert found["isolation"]["skipped"]["bwrap"] == \
        "bwrap is not installed (not on the server's PATH)"
    assert "(the server's own user)" in found["isolation"]["user"]
    assert found["sandboxed_tools"] == ["python", "shell"]
    assert found["disabled"] is True
    assert "install bubblewrap" in found["disabled_reason"]
    reachable = {item["what"] for item in found["secret_files"] if item["reachable"]}
    assert {"state folder", "keys file", "audit database"} <= reachable
    assert [item["variable"] for item in found["environment"]] == ["STARGRPC_JWT_SECRET"]
    assert "STARGRPC_JWT_SECRET: use jwt_secret_file" in found["fixes"]
    assert SECRET not in done.stdout

    text = doctor(env=env, prefix=image.prefix)
    assert text.returncode == 3
    assert "sandboxed tools: python, shell — DISABLED (SANDBOX_UNAVAILABLE)" in text.stdout
    assert "REACHABLE: keys file" in text.stdout
    assert "does not protect: network" in text.stdout


@pytest.mark.parametrize("how", ["environment", "config"])
def test_opted_in_weak_isolation_exits_1(image: ImageUser, how: str) -> None:
    args: list[str] = ["--json"]
    env = dict(image.env)
    if how == "config":  # the same settings file serve takes
        config = image.base / "stargrpc.toml"
        config.write_text("sandbox_allow_weak_isolation = true\n")
        config.chmod(0o644)
        args += ["--config", str(config)]
    else:
        env["STARGRPC_SANDBOX_ALLOW_WEAK_ISOLATION"] = "true"
    done = doctor(*args, env=env, prefix=image.prefix)
    assert done.returncode == 1
    found = report(done)
    assert found["disabled"] is False and found["weak"] is True
    assert found["allowed_by"] == "sandbox_allow_weak_isolation=true"


def test_isolation_minimum_is_reported(image: ImageUser) -> None:
    done = doctor("--json", env={**image.env, "STARGRPC_SANDBOX_ISOLATION_MIN": "unshare"},
                  prefix=image.prefix)
    assert done.returncode == 3
    assert "weaker than sandbox_isolation_min=unshare" in report(done)["disabled_reason"]


def test_bubblewrap_with_private_state_is_clean(tmp_path: Path) -> None:
    done = doctor("--json", env={"STARGRPC_STATE_DIR": str(tmp_path / "state")})
    found = report(done)
    if found["isolation"]["mode"] != "bwrap":
        pytest.skip("bubblewrap isolation is not available on this machine")
    assert done.returncode == 0
    assert not found["reachable"] and not found["disabled"] and not found["weak"]
    assert found["fixes"] == []


def test_invalid_settings_are_a_usage_error(tmp_path: Path) -> None:
    done = doctor(env={"STARGRPC_STATE_DIR": str(tmp_path), "STARGRPC_SANDBOX_USER": "root"})
    assert done.returncode == 2
    assert "sandbox_user 'root' is root" in done.stderr
