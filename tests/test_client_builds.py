"""The helpers that run the Go and Node clients: a client that hangs does not outlive its
test."""

from __future__ import annotations

import os
import secrets

import pytest

from tests import client_builds


def running_with(token: str) -> list[int]:
    """The processes whose command line holds ``token``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and name != str(os.getpid()):
            try:
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    if token.encode() in handle.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


async def test_a_client_that_hangs_is_killed_when_its_time_is_up(monkeypatch) -> None:
    monkeypatch.setattr(client_builds, "RUN_TIMEOUT", 1.0)
    token = f"60.{secrets.randbelow(10**9):09d}"  # a sleep of its own, found by its argument

    with pytest.raises(TimeoutError):
        await client_builds.run_node(["sleep", token])

    assert running_with(token) == []  # killed and reaped, not left running
