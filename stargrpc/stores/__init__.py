"""Run stores: where run event logs, run owners and idempotency claims live.

:class:`~stargrpc.stores.memory.MemoryRunStore` is the embedded default (one process);
:class:`~stargrpc.stores.redis.RedisRunStore` is shared by a fleet of replicas. One setting
picks between them: ``redis_url`` (``serve --redis-url`` / ``STARGRPC_REDIS_URL``), read by
:func:`stargrpc.stores.factory.make_store`.

The package itself imports nothing, so that validating a Redis URL (the settings use
:mod:`stargrpc.stores.connect`) does not load the run machinery.
"""
