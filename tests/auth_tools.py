"""Tools for the authentication and permission tests: they report who ran them."""

from __future__ import annotations

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, spec_of


@tool(read_only=True)
async def whoami(ctx: ToolContext) -> str:
    """Say who the caller is: "<principal as audited> <method> <sorted roles>"."""
    principal = ctx.principal
    return f"{principal.describe()} {principal.method} {','.join(sorted(principal.roles))}"


@tool(privileged=True)
async def danger(ctx: ToolContext) -> str:
    """A privileged tool."""
    return "done something dangerous"


@tool(allowed_roles=("ops",))
async def ops_only(ctx: ToolContext) -> str:
    """A tool that declares which role may run it."""
    return "ops work done"


def auth_registry() -> Registry:
    """whoami, danger (privileged) and ops_only (roles: ops)."""
    specs = [spec_of(fn) for fn in (whoami, danger, ops_only)]
    return Registry(spec for spec in specs if spec is not None)
