"""Settings: defaults < TOML file < environment < flags; secrets masked when shown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from stargrpc.settings import Settings, mask_url


def test_layers_override_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "stargrpc.toml"
    config.write_text('port = 6000\nhost = "0.0.0.0"\nlog_level = "debug"\n')
    monkeypatch.setenv("STARGRPC_PORT", "7000")

    settings = Settings.load(config, log_level="warning")

    assert settings.host == "0.0.0.0"  # from the file
    assert settings.port == 7000  # the environment beats the file
    assert settings.log_level == "warning"  # a flag beats both


def test_tools_dir_from_environment_is_a_path_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STARGRPC_TOOLS_DIR", "/opt/a:/opt/b")

    assert Settings.load().tools_dir == [Path("/opt/a"), Path("/opt/b")]


def test_bad_values_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("prot = 1\n")
    with pytest.raises(ValidationError):
        Settings.load(config)
    with pytest.raises(ValidationError):
        Settings.load(port=70000)


def test_urls_with_passwords_are_masked() -> None:
    assert mask_url("redis://:s3cret@cache:6379/0") == "redis://:***@cache:6379/0"
    assert mask_url("postgresql://app:pw@db/audit") == "postgresql://app:***@db/audit"
    assert mask_url("redis://cache:6379") == "redis://cache:6379"
    assert mask_url("redis://cache/0?ssl=1&password=s3cret") == "redis://cache/0?ssl=1&password=***"
    shown = Settings.load().masked()
    assert shown["port"] == 50051


def test_a_refused_setting_never_quotes_a_secret(tmp_path: Path) -> None:
    # The CLI prints a refused configuration's error (to a container's log, a journal): a
    # check of the whole model quoted every input, a JWT secret's first and last characters
    # with it.
    secret = "9f8e7d6c5b4a39281706f5e4d3c2b1a0aa99887766554433221100ffeeddccbb"
    done = subprocess.run(
        [sys.executable, "-m", "stargrpc.cli", "serve", "--port", "0"],
        env={**os.environ, "STARGRPC_JWT_SECRET": secret,
             "STARGRPC_STATE_DIR": str(tmp_path / "state")},
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "jwt_issuer" in done.stderr
    assert secret[:8] not in done.stdout + done.stderr
    assert secret[-8:] not in done.stdout + done.stderr
