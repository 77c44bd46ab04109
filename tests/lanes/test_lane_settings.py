"""The lanes settings from a TOML table and from JSON in the environment; what they refuse;
a tool naming a lane that is not configured stops the catalog."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from stargrpc.errors import ToolDefinitionError
from stargrpc.runs.lanes import LanePolicy
from stargrpc.runs.runtime import Runtime
from stargrpc.settings import Settings
from tests.lanes.lane_helpers import lane_registry


def test_lanes_from_a_toml_table(tmp_path: Path) -> None:
    config = tmp_path / "stargrpc.toml"
    config.write_text('lane_override_role = "router"\npriority_max_per_principal = 3\n'
                      '[lanes.heavy]\nmax_concurrent = 4\nmax_queued = 20\n'
                      'default_priority = 2\n[tool_lanes]\npython = "heavy"\n')
    settings = Settings.load(config)
    assert settings.lanes["heavy"].max_concurrent == 4
    assert settings.lanes["heavy"].default_priority == 2
    assert settings.tool_lanes == {"python": "heavy"}
    policy = LanePolicy(settings)
    assert set(policy.lanes) == {"default", "heavy"}  # default always exists
    assert set(policy.limited) == {"heavy"}  # and is unlimited unless configured
    assert (policy.override_role, policy.priority_max) == ("router", 3)


def test_lanes_from_json_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STARGRPC_LANES", '{"default": {"max_concurrent": 8}}')
    monkeypatch.setenv("STARGRPC_TOOL_LANES", '{"echo": "default"}')
    settings = Settings()
    assert settings.lanes["default"].max_concurrent == 8
    assert set(LanePolicy(settings).limited) == {"default"}


@pytest.mark.parametrize("bad", [
    {"lanes": {"bad name": {}}},
    {"lanes": {"x" * 65: {}}},
    {"lanes": {"heavy": {"max_concurrent": -1}}},
    {"lanes": {"heavy": {"max_queued": -1}}},
    {"lanes": {"heavy": {"unknown": 1}}},
    {"tool_lanes": {"python": "nowhere"}},
    {"priority_max_per_principal": -1},
])
def test_bad_lanes_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Settings(**bad)  # type: ignore[arg-type]


def test_a_tool_naming_an_unconfigured_lane_stops_the_catalog() -> None:
    with pytest.raises(ToolDefinitionError, match="names lane 'slow'"):
        Runtime(lane_registry(), settings=Settings(lanes={"timed": {"max_concurrent": 1}}))
    # Routed elsewhere by tool_lanes, it is fine.
    Runtime(lane_registry(), settings=Settings(
        lanes={"timed": {"max_concurrent": 1}},
        tool_lanes={"hold": "timed", "hold_urgent": "timed"}))
