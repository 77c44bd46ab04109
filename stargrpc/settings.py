"""Settings, in one place: flags override ``STARGRPC_*`` environment variables, which
override an optional TOML file (``--config`` / ``STARGRPC_CONFIG``), which overrides the
defaults below. :meth:`Settings.masked` is what start-up logs, with secrets hidden.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

MiB = 1024 * 1024


class Settings(BaseSettings):
    """Every setting of the server. Environment: ``STARGRPC_<NAME>``; TOML: ``name = …``."""

    model_config = SettingsConfigDict(env_prefix="STARGRPC_", extra="forbid",
                                      validate_default=True)

    # -- listening -------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")

    # -- state -----------------------------------------------------------------------------
    state_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("XDG_STATE_HOME")
                                     or Path.home() / ".local" / "state") / "stargrpc",
        description="Where the server keeps its files (keys file, audit database, indexes).")

    # -- tools -----------------------------------------------------------------------------
    tools_dir: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Extra tools directories, besides the bundled tools "
        "(environment: separated by the path separator).")
    bundled_tools: bool = Field(True, description="Load the bundled tools.")
    entry_point_tools: bool = Field(True, description="Load tools from the stargrpc.tools "
                                    "entry-point group.")

    # -- limits ----------------------------------------------------------------------------
    max_receive_message_bytes: int = Field(8 * MiB, ge=1024, description="Largest request "
                                           "message accepted by the transport.")
    max_send_message_bytes: int = Field(64 * MiB, ge=1024, description="Largest message sent.")
    max_argument_bytes: int = Field(1 * MiB, ge=2, description="Largest arguments payload.")
    max_argument_depth: int = Field(64, ge=1, le=512, description="Deepest argument nesting.")

    # -- runs ------------------------------------------------------------------------------
    run_retention_seconds: float = Field(600.0, ge=0, description="How long a finished run "
                                         "stays watchable.")
    max_finished_runs: int = Field(10_000, ge=0, description="Finished runs kept at most.")

    # -- lifecycle -------------------------------------------------------------------------
    shutdown_grace_seconds: float = Field(30.0, ge=0, description="How long in-flight runs "
                                          "may take to finish after SIGTERM.")
    keepalive_time_seconds: float = Field(30.0, gt=0, description="HTTP/2 keepalive ping "
                                          "interval.")
    keepalive_timeout_seconds: float = Field(10.0, gt=0, description="Time to wait for a "
                                             "keepalive ack.")

    # -- logging ---------------------------------------------------------------------------
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a terminal, JSON otherwise.")

    @field_validator("tools_dir", mode="before")
    @classmethod
    def _split_paths(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [Path(p) for p in value.split(os.pathsep) if p]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("STARGRPC_CONFIG")
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Settings from overrides (flags), the environment and an optional TOML file.

        Args:
            config_file: A TOML file; defaults to ``STARGRPC_CONFIG`` when set.
            overrides: Values given on the command line; None values are ignored.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        if config_file is None:
            return cls(**given)
        previous = os.environ.get("STARGRPC_CONFIG")
        os.environ["STARGRPC_CONFIG"] = str(config_file)
        try:
            return cls(**given)
        finally:
            if previous is None:
                os.environ.pop("STARGRPC_CONFIG", None)
            else:
                os.environ["STARGRPC_CONFIG"] = previous

    def masked(self) -> dict[str, Any]:
        """All settings as JSON-ready values, with secrets and URL passwords hidden."""
        shown: dict[str, Any] = {}
        for name, value in self:
            if isinstance(value, SecretStr):
                shown[name] = "***" if value.get_secret_value() else ""
            elif isinstance(value, str) and "://" in value:
                shown[name] = mask_url(value)
            elif isinstance(value, Path):
                shown[name] = str(value)
            elif isinstance(value, list):
                shown[name] = [str(v) for v in value]
            else:
                shown[name] = value
        return shown


def mask_url(url: str) -> str:
    """``redis://:secret@host`` → ``redis://:***@host``; other URLs unchanged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
