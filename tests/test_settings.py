"""Settings: defaults < TOML file < environment < flags; secrets masked when shown."""

from __future__ import annotations

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
    shown = Settings.load().masked()
    assert shown["port"] == 50051
