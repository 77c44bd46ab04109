"""Idempotency keys: what makes Execute safe to retry.

A key belongs to ``(principal, idempotency_key)``; keys never cross principals. The first
Execute with a key runs the tool. A repeat while that run is going **attaches** to it (same
run id, the full event stream from seq 1); a repeat after it ended **replays** the recorded
events and Result without running the tool again, for as long as the run is retained. A
repeat with another tool or other arguments (or, from a delegating caller, for another end
user) is refused with FAILED_PRECONDITION, ErrorInfo reason ``IDEMPOTENCY_KEY_REUSED``. In a
fleet, a run whose replica died loses its claim once its lease expires, so a retry on
another replica runs the tool again (once).

The claim itself lives in the run store (:meth:`stargrpc.stores.base.RunStore.claim`); this module
holds what is the same for every store: the fingerprint a key is checked against.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from stargrpc.errors import IdempotencyKeyReused

#: Longest idempotency key accepted; longer ones are refused rather than truncated, so two
#: different keys can never collide.
MAX_KEY_LENGTH = 256


def fingerprint(tool_name: str, arguments: Mapping[str, Any], acting_for: str = "") -> str:
    """A digest of what a key is used for: the tool and its arguments, canonically encoded
    (key order and whitespace do not matter), and the end user a delegating caller acts
    for: tools see it, so a run for one end user is never replayed to another (the same
    key for another end user is refused as reused)."""
    used_for: list[Any] = [tool_name, arguments]
    if acting_for:  # absent otherwise: the digests of other calls stay what they were
        used_for.append({"acting_for": acting_for})
    canonical = json.dumps(used_for, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_reuse(key: str, held: str, given: str, run_id: str) -> None:
    """Refuses a key reused for something else.

    Raises:
        IdempotencyKeyReused: ``held`` (the key's first use) differs from ``given``.
    """
    if held != given:
        shown = key if len(key) <= 64 else key[:64] + "…"
        raise IdempotencyKeyReused(
            "this idempotency key was already used with a different tool or arguments; "
            "use a new key for a new call",
            metadata={"idempotency_key": shown, "run_id": run_id})
