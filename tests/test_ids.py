"""Ids of runs and audit records: version-7 UUIDs whose time a replica reads back, unique,
in the order they were made, and other forms told apart (they are never waited for)."""

from __future__ import annotations

import time
import uuid

from stargrpc.ids import minted_ms, new_id


def test_run_ids_are_uuid7_hex_that_tell_when_they_were_made() -> None:
    before = int(time.time() * 1000)
    ids = [new_id() for _ in range(1000)]
    after = int(time.time() * 1000)

    assert len(set(ids)) == len(ids)
    for run_id in ids:
        parsed = uuid.UUID(hex=run_id)
        assert parsed.hex == run_id and len(run_id) == 32
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
        minted = minted_ms(run_id)
        assert minted is not None and before <= minted <= after


def test_ids_of_other_forms_have_no_time() -> None:
    for other in (uuid.uuid4().hex, "nope", "7" * 32, new_id()[:31] + "g", ""):
        assert minted_ms(other) is None


def test_ids_made_later_sort_later() -> None:
    # The audit trail's unique index on record ids then grows at its end (one page written
    # per append, not a page anywhere in the index).
    made = []
    for _ in range(5):
        made.append(new_id())
        started = time.monotonic_ns()
        while time.monotonic_ns() - started < 2_000_000:  # the next millisecond, and one more
            pass
    assert made == sorted(made)
