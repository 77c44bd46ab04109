"""An embedded ``StargrpcServer`` configures logging from its settings (``log_level``,
``log_format``) unless the embedding program configured it itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_EMBED = textwrap.dedent("""
    import asyncio, sys
    from stargrpc.logs import configure_logging
    from stargrpc.registry import Registry
    from stargrpc.server.grpc_server import StargrpcServer
    from stargrpc.settings import Settings

    level, own = sys.argv[1], sys.argv[2] == "own"
    if own:  # the program configures logging itself, to stderr
        configure_logging("info", "json", sys.stderr)

    async def main():
        settings = Settings(host="127.0.0.1", port=0, insecure_no_auth=True,
                            state_dir=sys.argv[3], log_level=level, log_format="json")
        server = StargrpcServer(settings, registry=Registry([]))
        await server.start()
        await server.stop(grace=0.5)

    asyncio.run(main())
""")


def _embed(tmp_path: Path, level: str, own: str = "server") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _EMBED, level, own, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=True)


def test_log_level_error_silences_info_lines(tmp_path: Path) -> None:
    quiet = _embed(tmp_path, "error")
    assert '"serving"' not in quiet.stdout + quiet.stderr
    assert quiet.stdout.strip() == ""

    chatty = _embed(tmp_path, "info")
    assert '"event":"serving"' in chatty.stdout.replace(" ", "")


def test_a_program_that_configured_logging_keeps_its_configuration(tmp_path: Path) -> None:
    embedded = _embed(tmp_path, "error", own="own")
    assert '"event":"serving"' in embedded.stderr.replace(" ", "")
    assert '"serving"' not in embedded.stdout
