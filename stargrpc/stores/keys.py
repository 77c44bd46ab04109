"""The key layout of the Redis run store, with hash tags on Redis Cluster.

A Lua script may touch only keys of one hash slot on a cluster. Every key of a run carries
the run id as its **hash tag** there, so the scripts that append, renew, end and register a
run each touch one slot::

    run:{<id>}          hash    owner, tool, replica, state
    run:{<id>}:events   stream  one entry per event
    run:{<id>}:lease    string  the running replica's token
    run:{<id>}:cancel   string  a pending CancelRun reason
    idem:{<digest>}     string  the idempotency claim of (principal, key)

An idempotency claim is found by (principal, key) alone, before the run it names is known,
so its slot cannot be the run's: on a cluster, claiming a key and registering its run are
**two steps**, made safe by their order (see :mod:`stargrpc.stores.redis`). On one Redis,
primary or behind Sentinel, every key lives on one node: the keys keep their untagged names
(``run:<id>``, ``run:<id>:events``, …, so an existing fleet upgrades in place) and one
script claims the key and registers its run atomically.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

#: What a run id can be (the 32 hex digits of :mod:`stargrpc.ids`, a UUID of earlier
#: versions): a run id a caller names that is not of this form names no run, and is never
#: made into a key — ``<id>:events`` would name a run's stream, not a run.
_RUN_ID_FORM = re.compile(r"[A-Za-z0-9._-]{1,128}")


def could_be_run_id(run_id: str) -> bool:
    """Whether ``run_id`` has the form of a run id (and so makes a key of that run only)."""
    return _RUN_ID_FORM.fullmatch(run_id) is not None


@dataclass(frozen=True)
class KeyLayout:
    """The names of the run store's keys.

    Attributes:
        prefix: Prefix of every key.
        tagged: Whether keys carry hash tags (Redis Cluster).
    """

    prefix: str
    tagged: bool = False

    def __post_init__(self) -> None:
        if self.tagged and ("{" in self.prefix or "}" in self.prefix):
            # A brace in the prefix would become every key's hash tag: one slot for all.
            raise ValueError("redis_key_prefix must not contain '{' or '}' on Redis Cluster")

    def run(self, run_id: str, part: str = "") -> str:
        """The key of a run's meta hash, or of its ``part`` (events, lease, cancel)."""
        name = f"{{{run_id}}}" if self.tagged else run_id
        return f"{self.prefix}run:{name}" + (f":{part}" if part else "")

    def run_keys(self, run_id: str) -> list[str]:
        """The keys of a run as the scripts take them: lease, events, meta."""
        return [self.run(run_id, "lease"), self.run(run_id, "events"), self.run(run_id)]

    def claim(self, owner: str, key: str) -> str:
        """The key of the idempotency claim of ``key`` by principal ``owner``."""
        # Hashed so that neither part can contain the separator of the other.
        digest = hashlib.sha256(json.dumps([owner, key]).encode()).hexdigest()
        return f"{self.prefix}idem:{{{digest}}}" if self.tagged else f"{self.prefix}idem:{digest}"


#: The first names of the keys the fleet keeps under ``redis_key_prefix`` (runs, their
#: indexes, idempotency claims, lanes, approvals, state, deliveries, sessions): no key that a
#: caller names (a Redis stream delivery's stream) may start with one, or the caller would
#: write into the store's own keys — another principal's run log, a lane's queue.
RESERVED_KEY_NAMES = ("run", "runs", "idem", "lane", "approval", "state", "delivery",
                      "session", "session-lease", "session-index", "page-token-key")


def is_reserved_key(name: str) -> bool:
    """Whether ``name`` (after the key prefix) is, or lies under, a key of the store."""
    return any(name == reserved or name.startswith((reserved + ":", reserved + "{"))
               for reserved in RESERVED_KEY_NAMES)


__all__ = ["RESERVED_KEY_NAMES", "KeyLayout", "could_be_run_id", "is_reserved_key"]
