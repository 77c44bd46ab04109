"""MCP, the Model Context Protocol: stargrpc's tools served to MCP clients, and the tools
of MCP servers behind stargrpc.

- :mod:`stargrpc.mcp.bridge`: MCP requests as ToolService calls (one pipeline for all).
- :mod:`stargrpc.mcp.mapping`: proto tools, events and Results as MCP types.
- :mod:`stargrpc.mcp.catalog`: the tools' schemas the bridge keeps between calls (so that a
  call checks its ``Mcp-Param-*`` headers without listing the catalog first).
- :mod:`stargrpc.mcp.server`: the streamable-HTTP endpoint of a server (``--mcp-port``).
- :mod:`stargrpc.mcp.sessions`: its door: every request authenticated, each session its
  principal's, and how many each principal may hold.
- :mod:`stargrpc.mcp.stdio`: the same bridge over stdio (``stargrpc mcp-stdio``).
- :mod:`stargrpc.mcp.tasks`: MCP tasks read from runs (a task is a run);
  :mod:`stargrpc.mcp.task_requests`: their requests in 2025-11-25 and 2026-07-28;
  :mod:`stargrpc.mcp.run_events`: the ``io.stargrpc/run-events`` extension.
- :mod:`stargrpc.mcp.upstream`, :mod:`stargrpc.mcp.schemas`: MCP servers behind stargrpc
  (``mcp_servers``).

They need the official SDK, an extra (``pip install 'stargrpc[mcp]'``), so that the Python
SDK (:mod:`stargrpc.client`) installs beside an agent framework pinned to another ``mcp``.
Nothing outside this package imports them (or ``mcp``) at module level: what needs them
calls :func:`require_mcp` first, which names the extra when it is missing. This package
itself imports nothing of the SDK until one of its names is used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from packaging.requirements import Requirement

from stargrpc.errors import MissingExtra

if TYPE_CHECKING:
    from stargrpc.mcp.bridge import Bridge
    from stargrpc.mcp.mapping import IDEMPOTENCY_META_KEY
    from stargrpc.settings import Settings

__all__ = ["IDEMPOTENCY_META_KEY", "MCP_REQUIREMENT", "Bridge", "require_mcp",
           "require_mcp_for"]

#: The SDK the MCP features are written against: the ``mcp`` extra's requirement in
#: pyproject.toml (tests/mcp/test_extra.py checks they say the same).
MCP_REQUIREMENT = "mcp>=2.3"
_REQUIRED = Requirement(MCP_REQUIREMENT)

_LAZY = {"Bridge": "stargrpc.mcp.bridge", "IDEMPOTENCY_META_KEY": "stargrpc.mcp.mapping"}


def require_mcp(feature: str) -> None:
    """Checks that the MCP SDK of the ``mcp`` extra is installed.

    Args:
        feature: What needs it, as the user asked for it (``--mcp-port``, ``mcp_servers``).

    Raises:
        MissingExtra: It is not installed, or an older ``mcp`` is, naming what to install.
    """
    try:
        found = importlib.metadata.version("mcp")
    except importlib.metadata.PackageNotFoundError:
        found = ""
    if found and _REQUIRED.specifier.contains(found, prereleases=True):
        return
    have = f"mcp {found} is installed" if found else "mcp is not installed"
    raise MissingExtra(
        f"{feature} needs stargrpc's MCP extra ({MCP_REQUIREMENT}), and {have}: "
        "pip install 'stargrpc[mcp]'")


def require_mcp_for(settings: Settings) -> None:
    """Checks that the MCP SDK is installed when ``settings`` ask for an MCP feature.

    Raises:
        MissingExtra: ``mcp_port`` or ``mcp_servers`` is set and the extra is missing.
    """
    if settings.mcp_port is not None:
        require_mcp("the MCP endpoint (--mcp-port, STARGRPC_MCP_PORT)")
    if settings.mcp_servers:
        require_mcp("mcp_servers")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
