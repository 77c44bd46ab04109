"""What a run knows of the session it was called in (``ctx.session``), as a protocol.

The runs layer sits below the sessions and the sandbox, which import it; the handle a
session gives its runs (:class:`stargrpc.sessions.session.SessionHandle`) is described here
by what runs and tools use of it, so that naming its type closes no import loop.
"""

from __future__ import annotations

from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class RunSession(Protocol):
    """A run's session: ``ctx.session``.

    Attributes:
        session_id: The session.
        kind: "python" or "shell".
        folder: The session's folder on the server's host (its code owns it: use
            :meth:`read_file` and :meth:`write_file`, never a path under it).
        no_wait: The caller asked not to wait for a busy session.
    """

    session_id: str
    kind: str
    folder: Path
    no_wait: bool

    def write_file(self, name: str, data: bytes | str) -> None:
        """Writes a plain file of the session's folder, never through a symlink."""

    def read_file(self, name: str, limit: int = ...) -> bytes:
        """Reads a regular file of the session's folder, never through a symlink."""

    async def hold(self, tool: Coroutine[Any, Any, T]) -> T:
        """Runs the tool's coroutine once the session's turn is its own."""
