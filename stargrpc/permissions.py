"""Who may run which tool. The runtime asks a :class:`ToolPolicy` before every run and
ListTools asks it which tools a caller may run."""

from __future__ import annotations

from typing import Protocol

from stargrpc.principal import Principal
from stargrpc.registry import ToolSpec


class ToolPolicy(Protocol):
    """Decides whether a principal may run a tool."""

    def can_run(self, principal: Principal, spec: ToolSpec) -> bool:
        """Whether ``principal`` may run ``spec``."""
        ...

    def check(self, principal: Principal, spec: ToolSpec) -> None:
        """Returns when ``principal`` may run ``spec``.

        Raises:
            PermissionDenied: With ErrorInfo naming the tool and why.
        """
        ...


class AllowAll:
    """Every caller may run every tool: for an unauthenticated local server only."""

    def can_run(self, principal: Principal, spec: ToolSpec) -> bool:
        return True

    def check(self, principal: Principal, spec: ToolSpec) -> None:
        return None
