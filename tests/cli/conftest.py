"""The CLI tests use the client tests' recorded server."""

from __future__ import annotations

from tests.client.conftest import recorded_server, recorder

__all__ = ["recorded_server", "recorder"]
