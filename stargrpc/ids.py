"""Ids of runs and audit records: 32 hex digits, UUIDs of version 7.

A version-7 UUID is the time it was made (ms since the epoch) followed by 74 random bits:
unguessable like any random UUID, and in the order it was made. A replica that is asked
about a run it cannot find yet can tell from the run's id alone whether the run was only
just admitted on another replica (and reaches the shared store with its first write in a
moment) or is unknown; and an index on record ids (the PostgreSQL trail's unique one, and
that of SQLite trails made by earlier versions) grows at its end, where a random id would
dirty a page anywhere in it on every append (more to write per commit and per checkpoint,
the more so the longer the trail).
"""

from __future__ import annotations

import os
import time

_MS_BITS = 48
_VERSION = 0x7
_VARIANT = 0b10


def new_id() -> str:
    """A new id, made now."""
    ms = time.time_ns() // 1_000_000 & ((1 << _MS_BITS) - 1)
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits; 74 are used
    value = (ms << 80 | _VERSION << 76 | (rand >> 62 & 0xFFF) << 64 | _VARIANT << 62
             | rand & ((1 << 62) - 1))
    return f"{value:032x}"


def minted_ms(run_id: str) -> int | None:
    """When :func:`new_id` made ``run_id`` (ms since the epoch, by that host's clock), or
    None for an id of another form (a random UUID of earlier versions, anything else)."""
    if len(run_id) != 32 or run_id[12] != "7" or run_id[16] not in "89ab":
        return None
    try:
        int(run_id, 16)
    except ValueError:
        return None
    return int(run_id[:12], 16)

