"""Which run store a server uses, from its settings."""

from __future__ import annotations

from stargrpc.settings import Settings
from stargrpc.stores.base import RunStore
from stargrpc.stores.memory import MemoryRunStore


def make_store(settings: Settings) -> RunStore:
    """The run store ``settings`` describe: Redis when ``redis_url`` is set, else memory."""
    if settings.redis_url:
        from stargrpc.stores.redis import RedisRunStore  # only a fleet needs the client

        return RedisRunStore.from_settings(settings)
    return MemoryRunStore(settings.run_retention_seconds, settings.max_finished_runs,
                          settings.max_finished_run_bytes)


