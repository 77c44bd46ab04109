"""The process table, for tests that check a sandboxed run left nothing behind."""

from __future__ import annotations

import contextlib
import os
import uuid

from tests.helpers import eventually


def marker() -> str:
    """A token unique to one test, to put on the command lines it starts."""
    return f"sbxmark{uuid.uuid4().hex[:12]}"


def processes_with(token: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains ``token``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                cmdline = handle.read()
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmdline and state != b"Z":
            found.append(int(entry.name))
    return found


async def wait_until_gone(token: str, within: float = 10.0) -> list[int]:
    """Waits for every process carrying ``token`` to be gone; returns the survivors (for the
    test's assertion to name, and for it to kill)."""
    # The process table has no event to await: poll it, bounded.
    with contextlib.suppress(AssertionError):
        await eventually(lambda: not processes_with(token), within=within, interval=0.05,
                         what=f"the processes marked {token} gone")
    return processes_with(token)


async def wait_until_running(token: str, within: float = 10.0, count: int = 1) -> list[int]:
    """Waits for ``count`` processes carrying ``token`` to exist; returns those found."""
    with contextlib.suppress(AssertionError):
        await eventually(lambda: len(processes_with(token)) >= count, within=within,
                         interval=0.05, what=f"{count} processes marked {token} running")
    return processes_with(token)
