"""The flusher's own connection to one Redis, driven directly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

try:  # installed with redis[hiredis]; without it redis-py packs commands itself
    import hiredis
except ImportError:  # pragma: no cover - hiredis is a declared dependency
    hiredis = None  # type: ignore[assignment]

from stargrpc.stores.redis.errors import check_acknowledged


def pack(conn: Any, commands: list[tuple[Any, ...]]) -> list[bytes]:
    """The commands in Redis's wire protocol: packed by hiredis in C when it is installed
    (the same bytes as redis-py's asyncio connection packs, in a fraction of the time)."""
    if hiredis is None:
        return list(conn.pack_commands(commands))
    return [hiredis.pack_command(command) for command in commands]


class FlushConnection:
    """One connection of the flusher's own, driven directly: the script calls of a round
    trip are packed and sent in one write and their replies read back in order.

    redis-py's client takes a pooled connection, a lock and a retry wrapper on every
    command, and enforces its socket timeout with a task per command; the flusher runs on
    every run, one round trip at a time, so it keeps a connection of its own, made like the
    client's but without socket timeout (the flusher bounds each round trip itself). Any
    failure drops the connection (a reply may be half read); the next round trip connects
    afresh.
    """

    def __init__(self, client: Redis) -> None:
        pool = client.connection_pool
        self._conn: Any = pool.connection_class(
            **{**pool.connection_kwargs, "socket_timeout": None})

    @property
    def socket_timeout(self) -> float | None:
        """The connection's socket timeout (none: the flusher bounds its round trips)."""
        return self._conn.socket_timeout

    async def call_all(self, sha: str, calls: list[tuple[list[str], list[Any]]],
                       wait: tuple[int, int] | None = None,
                       before: Sequence[tuple[Any, ...]] = ()) -> list[Any]:
        """Each call's reply, or the error Redis answered it with; with ``wait`` (replicas,
        timeout in ms), WAIT follows the calls on the same connection. The commands
        ``before`` go ahead of the calls in the same write; their replies are dropped.

        Raises:
            RedisError: Redis could not be reached (or cut the connection), or
                (:class:`~stargrpc.stores.redis.errors.NotReplicated`) not enough replicas
                acknowledged the calls.
        """
        commands: list[tuple[Any, ...]] = [*before, *(("EVALSHA", sha, len(keys), *keys, *args)
                                                      for keys, args in calls)]
        if wait is not None:
            commands.append(("WAIT", *wait))
        replies = (await self.commands(commands))[len(before):]
        if wait is not None:
            try:
                check_acknowledged(replies[len(calls):], *wait)
            except BaseException:
                await self._conn.disconnect(nowait=True)
                raise
        return replies[:len(calls)]

    async def commands(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Each command's reply, or the error Redis answered it with, in one round trip.

        Raises:
            RedisError: Redis could not be reached (or cut the connection).
        """
        conn = self._conn
        try:
            await conn.send_packed_command(pack(conn, commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:  # this call's answer; the others still come
                    replies.append(exc)
            return replies
        except BaseException:
            await conn.disconnect(nowait=True)
            raise

    async def aclose(self) -> None:
        """Closes the connection."""
        await self._conn.disconnect()
