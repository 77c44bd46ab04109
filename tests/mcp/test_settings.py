"""The MCP settings: ``mcp_port`` from the flag and the environment, refused beside client
certificates, and a port that cannot be bound stops start-up with a clear error."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from stargrpc.cli import main
from stargrpc.mcp.server import McpEndpoint
from stargrpc.settings import Settings
from tests.conftest import ServerFactory


def test_mcp_port_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STARGRPC_MCP_PORT", "8765")
    assert Settings.load().mcp_port == 8765
    assert Settings.load(mcp_port=9000).mcp_port == 9000  # the flag wins


def test_mcp_port_is_refused_with_client_certificates(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("unused")
    with pytest.raises(ValidationError, match="mcp_port"):
        Settings.load(mcp_port=0, tls_cert_file=pem, tls_key_file=pem, tls_client_ca_file=pem)


def test_the_commands_offer_the_flags() -> None:
    runner = CliRunner()
    assert "--mcp-port" in runner.invoke(main, ["serve", "--help"]).output
    stdio = runner.invoke(main, ["mcp-stdio", "--help"]).output
    assert "--target" in stdio and "--api-key" in stdio


def test_the_progress_threshold_is_bounded_from_the_environment_and_the_flag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.load().mcp_progress_after_seconds == 0.5
    monkeypatch.setenv("STARGRPC_MCP_PROGRESS_AFTER_SECONDS", "0")
    assert Settings.load().mcp_progress_after_seconds == 0
    for bad in ("-0.1", "3600.5", "soon", "nan", "1e400"):
        monkeypatch.setenv("STARGRPC_MCP_PROGRESS_AFTER_SECONDS", bad)
        with pytest.raises(ValidationError, match="mcp_progress_after_seconds"):
            Settings.load()
    monkeypatch.delenv("STARGRPC_MCP_PROGRESS_AFTER_SECONDS")
    runner = CliRunner()
    for bad in ("-1", "3601", "soon", ""):
        refused = runner.invoke(main, ["mcp-stdio", "--target", "127.0.0.1:9",
                                       "--progress-after-seconds", bad])
        assert refused.exit_code == 2 and "--progress-after-seconds" in refused.output


async def test_a_taken_mcp_port_fails_start_up_and_leaves_nothing_running(
        make_server: ServerFactory) -> None:
    server = await make_server()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = server.settings.model_copy(update={"mcp_port": taken.getsockname()[1]})
        endpoint = McpEndpoint(settings, server.port)
        with pytest.raises(OSError):
            await endpoint.start()
    await endpoint.stop()  # already stopped: nothing to do
    fresh = McpEndpoint(server.settings.model_copy(update={"mcp_port": 0}), server.port)
    assert await fresh.start()
    await fresh.stop()
