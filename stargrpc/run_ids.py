"""Run ids: 32 hex digits, a UUID of version 7 — the time it was made (ms since the epoch)
followed by 74 random bits.

Unguessable like any random UUID, and a replica that is asked about a run it cannot find yet
can tell from its id alone whether the run was only just admitted on another replica (and
reaches the shared store with its first write in a moment) or is unknown.
"""

from __future__ import annotations

import os
import time

_MS_BITS = 48
_VERSION = 0x7
_VARIANT = 0b10


def new_run_id() -> str:
    """A new run id, made now."""
    ms = time.time_ns() // 1_000_000 & ((1 << _MS_BITS) - 1)
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits; 74 are used
    value = (ms << 80 | _VERSION << 76 | (rand >> 62 & 0xFFF) << 64 | _VARIANT << 62
             | rand & ((1 << 62) - 1))
    return f"{value:032x}"


def minted_ms(run_id: str) -> int | None:
    """When :func:`new_run_id` made ``run_id`` (ms since the epoch, by that host's clock), or
    None for an id of another form (a random UUID of earlier versions, anything else)."""
    if len(run_id) != 32 or run_id[12] != "7" or run_id[16] not in "89ab":
        return None
    try:
        int(run_id, 16)
    except ValueError:
        return None
    return int(run_id[:12], 16)


__all__ = ["minted_ms", "new_run_id"]
