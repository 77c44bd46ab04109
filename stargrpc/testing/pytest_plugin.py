"""pytest fixtures for testing tools through a real server (registered under the
``pytest11`` entry point, so installing stargrpc makes them available)::

    async def test_count(stargrpc_server):
        served = await stargrpc_server(count, keys={"alice": ["analyst"]})
        result = await served.client("alice").call("count", {"to": 2})

``stargrpc_server`` starts servers on ``127.0.0.1:0`` (see
:func:`stargrpc.testing.serve_tools`) and stops each at the end of the test. Async tests
need an asyncio plugin such as pytest-asyncio.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:  # the server is imported by the fixture, not whenever pytest starts
    from stargrpc.registry import ToolSpec
    from stargrpc.settings import Settings
    from stargrpc.testing import ServedTools


class ServerFactory(Protocol):
    """Starts a server: ``await stargrpc_server(*tools, keys=…, settings=…, **settings)``."""

    async def __call__(self, *tools: Callable[..., Any] | ToolSpec,
                       keys: Mapping[str, Iterable[str]] | None = None,
                       settings: Settings | None = None, **overrides: Any) -> ServedTools:
        ...


@pytest.fixture
async def stargrpc_server() -> AsyncIterator[ServerFactory]:
    """A factory of real servers running given tools, with API keys for given callers and
    roles (authentication off when no keys are given); each is stopped after the test."""
    from stargrpc.testing import serve_tools

    async with AsyncExitStack() as stack:
        async def start(*tools: Callable[..., Any] | ToolSpec,
                        keys: Mapping[str, Iterable[str]] | None = None,
                        settings: Settings | None = None, **overrides: Any) -> ServedTools:
            return await stack.enter_async_context(
                serve_tools(*tools, keys=keys, settings=settings, **overrides))

        yield start
