"""The ListRuns index: the sorted sets of every run and of each principal's runs, the
listing that reads them, and the key that signs page tokens."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from typing import Any

import structlog
from redis.exceptions import RedisError

from stargrpc.ids import minted_ms
from stargrpc.stores.background import stop_background
from stargrpc.stores.base import RunPage, RunQuery, RunSummary
from stargrpc.stores.redis.connection import FlushConnection
from stargrpc.stores.redis.errors import KeyVanished, as_redis_error, reachable, request_error
from stargrpc.stores.redis.leases import Sweep
from stargrpc.stores.redis.logs import RedisRunLog
from stargrpc.stores.redis.shared import Shared
from stargrpc.v1 import events_pb2

log = structlog.get_logger("stargrpc.stores.redis")

#: Most run ids an index keeps (oldest dropped first); expired runs leave it sooner.
INDEX_MAX_RUNS = 100_000
#: ListRuns looks at most this many index entries per page (filters may skip many).
LIST_SCAN_MAX = 2_000
#: Index entries read per round trip of a listing.
_LIST_CHUNK = 100


class RunIndex:
    """The runs ListRuns finds: written when a run is registered and when it ends (apart
    from the run's scripts: on a cluster the indexes live in slots of their own), read a
    page at a time."""

    _shared: Shared
    _sweep: Sweep
    _aside: set[asyncio.Task[None]]
    _page_token_key: bytes | None

    def __init__(self, shared: Shared, sweep: Sweep) -> None:
        self._shared = shared
        self._sweep = sweep
        self._aside = set()  # sweep-set writes sent beside a registration (cluster)
        self._page_token_key = None  # read from Redis when first needed

    def keys_of(self, owner: str) -> list[str]:
        """The run indexes a run of ``owner`` is in: every run's, then its principal's."""
        return [self.key(None), self.key(owner)]

    def tree_key(self, root_run_id: str) -> str:
        """The index of the runs of one call tree (its root and every run below it)."""
        digest = hashlib.sha256(root_run_id.encode()).hexdigest()[:40]
        return f"{self._shared.prefix}runs:tree:{digest}"

    def key(self, owner: str | None) -> str:
        """The index of ``owner``'s runs; of every run for None."""
        prefix = self._shared.prefix
        if owner is None:
            return f"{prefix}runs:all"
        # Hashed: a principal id may hold any character.
        return f"{prefix}runs:owner:{hashlib.sha256(owner.encode()).hexdigest()[:40]}"

    async def add(self, logs: list[RedisRunLog], line: FlushConnection | None = None) -> None:
        """Puts runs into the ListRuns indexes and pushes the indexes' TTL out (and into
        ``runs:running``, or out of it when they ended: see
        :meth:`~stargrpc.stores.redis.leases.Sweep.commands`). Best effort: a run missing
        from a listing for a while is better than a call that fails for it. On ``line``
        (the flusher's own connection) when given, else through the client."""
        if not logs:
            return
        shared = self._shared
        commands: list[tuple[Any, ...]] = []
        for run_log in logs:
            for key in self.keys_of(run_log.owner):
                commands.append(("ZADD", key, run_log.started_ms, run_log.run_id))
                commands.append(("ZREMRANGEBYRANK", key, 0, -(INDEX_MAX_RUNS + 1)))
                # Every write sets the same TTL from now: it only ever grows.
                commands.append(("PEXPIRE", key, shared.running_ttl_ms))
            if run_log.parent_run_id:
                # A run below a root: in its tree's index, with the root (placed at the time
                # its id holds), so ListRuns(root_run_id) reads the tree alone.
                root = run_log.root_run_id
                key = self.tree_key(root)
                commands.append(("ZADD", key, run_log.started_ms, run_log.run_id,
                                 minted_ms(root) or run_log.started_ms, root))
                commands.append(("PEXPIRE", key, shared.running_ttl_ms))
            commands.extend(self._sweep.commands(run_log))
        await self._write(commands, len(logs), line)

    async def _write(self, commands: list[tuple[Any, ...]], runs: int,
                     line: FlushConnection | None = None) -> None:
        """Sends index ``commands`` (of ``runs`` runs), best effort: a failure is logged."""
        shared = self._shared
        try:
            async with asyncio.timeout(shared.timeout):
                if line is not None:
                    # The flusher's connection, packed by hiredis: the client's pipeline
                    # costs several times more CPU for the same commands.
                    with as_redis_error():
                        failed = [r for r in await line.commands(commands)
                                  if isinstance(r, Exception)]
                    if failed:
                        raise failed[0]
                    return
                with as_redis_error():
                    async with shared.redis.pipeline(transaction=False) as pipe:
                        for command in commands:
                            pipe.execute_command(*command)
                        await pipe.execute()
        except (RedisError, TimeoutError) as exc:
            log.warning("redis_run_index_failed", runs=runs, error=str(exc) or "timeout")

    def sweep_commands(self, logs: list[RedisRunLog]) -> list[tuple[Any, ...]]:
        """What puts runs about to be registered into ``runs:running`` (see
        :meth:`~stargrpc.stores.redis.leases.Sweep.commands`), for the caller to send
        ahead of the registering script in its round trip: were the replica to die before
        its next round trip, a registered run outside the set would never be swept.
        :meth:`add` puts them there again once registered.

        On a cluster the set lives in a slot of its own, maybe on another node than the
        runs': the commands are sent here, beside the registration, in the background (a
        node down or stalled there must neither fail nor hold it up), and none returned."""
        commands = [command for run_log in logs for command in self._sweep.commands(run_log)]
        if commands and self._shared.cluster:
            task = asyncio.create_task(self._write(commands, len(logs)),
                                       name="redis-sweep-set-aside")
            self._aside.add(task)  # held until done: the loop keeps only a weak reference
            task.add_done_callback(self._aside.discard)
            return []
        return commands

    async def aclose(self) -> None:
        """Lets the writes sent in the background end (each bounded by the store's
        timeout); stops any still going past that."""
        if self._aside:
            await asyncio.wait(set(self._aside), timeout=self._shared.timeout + 1.0)
        for task in list(self._aside):
            await stop_background(task, "redis-sweep-set-aside")

    async def count_tree_runs(self, root_run_id: str, delta: int, ttl_ms: int) -> int:
        """Adds ``delta`` to the count of runs the call tree of ``root_run_id`` started on
        every replica (``runs:tree:<hash>:count``, gone ``ttl_ms`` after its last change);
        the new count.

        Raises:
            RequestError: Redis could not be reached (UNAVAILABLE).
        """
        key = self.tree_key(root_run_id) + ":count"
        with reachable("counting the call tree's runs"):
            async with self._shared.redis.pipeline(transaction=False) as pipe:
                pipe.incrby(key, delta)
                pipe.pexpire(key, max(1, ttl_ms))
                total, _ = await pipe.execute()
        return int(total)

    async def page_token_key(self) -> bytes:
        """The key that signs ListRuns page tokens, the same for every replica.

        Raises:
            RequestError: Redis could not be reached (UNAVAILABLE).
        """
        if self._page_token_key is None:
            # One key for every replica: the first to need it writes it, the rest read it.
            # (Lost with Redis's data, it is made again: older tokens are then refused.)
            redis = self._shared.redis
            name = f"{self._shared.prefix}page-token-key"
            with reachable("reading the page token key"):
                await redis.set(name, secrets.token_hex(32), nx=True)
                value = await redis.get(name)
            if value is None:  # removed between the two commands: try again next time
                raise request_error(KeyVanished("the page token key"),
                                    "reading the page token key")
            self._page_token_key = value if isinstance(value, bytes) else value.encode()
        return self._page_token_key

    async def list_runs(self, query: RunQuery) -> RunPage:
        """A page of the runs ``query`` asks for, newest first.

        Raises:
            RequestError: Redis could not be reached (UNAVAILABLE).
        """
        redis = self._shared.redis
        key = self.tree_key(query.root_run_id) if query.root_run_id else self.key(query.owner)
        top: int | str = "+inf" if query.after is None else query.after[0]
        runs: list[RunSummary] = []
        position: tuple[int, str] | None = None
        offset = 0
        while offset < LIST_SCAN_MAX:
            with reachable("listing runs"):
                entries: Any = await redis.zrevrangebyscore(
                    key, top, "-inf", start=offset, num=_LIST_CHUNK, withscores=True)
                if not entries:
                    return RunPage(runs, None)
                offset += len(entries)
                # Equal scores come in reverse order of id, as positions compare.
                wanted = [(int(score), member.decode()) for member, score in entries]
                wanted = [at for at in wanted if query.is_after_cursor(at)]
                async with redis.pipeline(transaction=False) as pipe:
                    for _, run_id in wanted:
                        pipe.hgetall(self._shared.key(run_id))
                    metas = await pipe.execute()
                expired = [run_id for (_, run_id), meta in zip(wanted, metas, strict=True)
                           if not meta]
                if expired:
                    await redis.zrem(key, *expired)
            for (started, run_id), meta in zip(wanted, metas, strict=True):
                if not meta:
                    continue
                summary = self._summary(run_id, started, meta)
                if query.admits(summary):
                    if len(runs) == query.limit:
                        return RunPage(runs, runs[-1].position)
                    runs.append(summary)
                position = (started, run_id)
        # Looked at enough for one call: the next page goes on from here.
        return RunPage(runs, position)

    def _summary(self, run_id: str, started_ms: int, meta: dict[bytes, bytes]) -> RunSummary:
        local = self._shared.runs.get(run_id)
        if local is not None:  # running here: fresher than what was last written
            return local.summary()
        written = json.loads(meta.get(b"summary", b"{}"))
        finished = meta.get(b"state", b"running") != b"running"
        # A run ended by the store (its replica lost, a conflict) has no outcome written.
        outcome = int(written.get("outcome", 0)) or (events_pb2.OUTCOME_ERROR if finished else 0)
        return RunSummary(run_id, meta.get(b"owner", b"").decode(),
                          meta.get(b"tool", b"").decode(), started_ms, finished=finished,
                          outcome=outcome, ended_ms=int(written.get("ended", 0)),
                          last_seq=int(written.get("seq", 0)),
                          current_step="" if finished else str(written.get("step", "")),
                          parent_run_id=str(written.get("parent", "")),
                          root_run_id=str(written.get("root", "")),
                          depth=int(written.get("depth", 0)),
                          lane=str(written.get("lane", "")),
                          priority=int(written.get("priority", 0)))


def tree_of(meta: dict[bytes, bytes]) -> tuple[str, str, int] | None:
    """Where a run sits in its call tree, as its meta hash's summary says: (parent, root,
    depth), or None for a top-level run (or one whose first batch is not written yet)."""
    try:
        written = json.loads(meta.get(b"summary", b"{}"))
    except ValueError:
        return None
    parent = written.get("parent") if isinstance(written, dict) else None
    if not parent:
        return None
    return str(parent), str(written.get("root", "")), int(written.get("depth", 0))
