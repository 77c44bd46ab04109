"""Fixtures of the approval tests: a server with authentication and audit on, and the
people who call it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.approval.approval_helpers import People, approval_registry, people_of


@pytest.fixture
async def auth(make_auth_server):
    """A server with the approval tools, API keys and its audit trail."""
    return await make_auth_server(approval_registry(), approval_timeout_seconds=60)


@pytest.fixture
async def people(auth) -> AsyncIterator[People]:
    """alice, bob and carol (approvers), mallory and root (admin) calling :func:`auth`."""
    async with people_of(auth) as found:
        yield found
