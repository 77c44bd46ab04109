"""``redis_url`` parsed, and the Redis client it describes: one Redis, a Redis Cluster, or
the primary that Sentinel names.

``redis://host:port/db`` (``rediss://`` for TLS, ``unix://`` for a socket)
    One Redis (a primary).
``redis+cluster://host:port[,host:port…]`` (``rediss+cluster://`` for TLS)
    A Redis Cluster: any of its nodes (the client learns the others and follows slots as they
    move and replicas as they are promoted).
``redis+sentinel://host:port[,host:port…]/service_name[/db]`` (``rediss+sentinel://``)
    The primary that these Sentinels name ``service_name``: after a failover the client asks
    them again and reconnects to the promoted replica.

A password (``redis+cluster://:secret@…``) or user and password apply to every Redis node;
Sentinels are asked without them unless ``?sentinel_auth=1`` is given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, unquote

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

Topology = Literal["single", "cluster", "sentinel"]

_SCHEMES: dict[str, tuple[Topology, bool]] = {
    "redis": ("single", False), "rediss": ("single", True), "unix": ("single", False),
    "redis+cluster": ("cluster", False), "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False), "rediss+sentinel": ("sentinel", True),
}
_URL = re.compile(r"^(?P<scheme>[a-z+]+)://(?:(?P<user>[^:@/]*)(?::(?P<password>[^@/]*))?@)?"
                  r"(?P<hosts>[^/?#]*)(?P<path>/[^?#]*)?(?:\?(?P<query>[^#]*))?$")
_HOST = re.compile(r"^(?:\[(?P<ip6>[0-9a-fA-F:.]+)\]|(?P<host>[^:\[\]]+))(?::(?P<port>\d+))?$")


@dataclass(frozen=True)
class RedisTarget:
    """What ``redis_url`` names.

    Attributes:
        topology: single | cluster | sentinel.
        url: The URL as given (for a single Redis, handed to redis-py as is).
        hosts: The cluster's seed nodes or the Sentinels, as (host, port).
        service: The Sentinel service name of the primary.
        db: The database number (single and sentinel; a cluster has only 0).
        username: The user of every Redis node, if any.
        password: The password of every Redis node, if any.
        tls: Whether connections use TLS.
        sentinel_auth: Whether Sentinels are asked with the same credentials.
    """

    topology: Topology
    url: str
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_auth: bool = False


def parse_redis_url(url: str) -> RedisTarget:
    """The target ``url`` names.

    Raises:
        ValueError: The URL is malformed; the message says how.
    """
    match = _URL.match(url)
    scheme = match["scheme"] if match else url.split("://", 1)[0]
    if scheme not in _SCHEMES:
        raise ValueError(f"redis_url scheme {scheme!r} is not one of "
                         f"{', '.join(s + '://' for s in _SCHEMES)}")
    topology, tls = _SCHEMES[scheme]
    if topology == "single":
        return RedisTarget("single", url, tls=tls)
    assert match is not None
    default_port = 26379 if topology == "sentinel" else 6379
    hosts = tuple(_host(part, default_port) for part in match["hosts"].split(",") if part)
    if not hosts:
        raise ValueError(f"redis_url {scheme}:// needs at least one host:port")
    path = [unquote(p) for p in (match["path"] or "").split("/") if p]
    query = {k: v[-1] for k, v in parse_qs(match["query"] or "").items()}
    user = unquote(match["user"]) if match["user"] else None
    password = unquote(match["password"]) if match["password"] is not None else None
    if topology == "cluster":
        if path and path != ["0"]:
            raise ValueError("redis_url redis+cluster:// takes no database (a cluster has "
                             "only database 0)")
        return RedisTarget("cluster", url, hosts, username=user, password=password, tls=tls)
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("redis_url redis+sentinel:// needs the service name: "
                         "redis+sentinel://host:port[,host:port…]/service_name[/db]")
    return RedisTarget("sentinel", url, hosts, service=path[0],
                       db=int(path[1]) if len(path) == 2 else 0, username=user,
                       password=password, tls=tls,
                       sentinel_auth=query.get("sentinel_auth", "0") in ("1", "true"))


def _host(part: str, default_port: int) -> tuple[str, int]:
    match = _HOST.match(part.strip())
    if match is None:
        raise ValueError(f"redis_url host {part!r} is not host:port")
    return match["ip6"] or match["host"], int(match["port"] or default_port)


def connect(url: str, *, timeout: float) -> tuple[Redis | RedisCluster, Topology]:
    """A client of the Redis ``url`` names, with fail-fast timeouts, and its topology.

    One quick retry replaces a pooled connection broken by a Redis restart transparently; a
    Redis that is really down fails the call fast.
    """
    target = parse_redis_url(url)
    common: dict[str, Any] = {"socket_timeout": timeout + 1.0,
                              "socket_connect_timeout": timeout}
    retry = Retry(ExponentialBackoff(cap=0.2, base=0.05), 1)
    if target.topology == "single":
        return Redis.from_url(url, retry=retry, **common), "single"
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.topology == "cluster":
        # reinitialize_steps=0: a MOVED reply (a slot moved, or a replica promoted) patches
        # the client's slot table with the node it names. By default redis-py instead
        # rebuilds the table on every fifth MOVED by closing every connection of the client,
        # those of other commands in flight included: during a resharding that broke
        # watchers' reads, claims and flushes all over the fleet (connection errors for
        # commands that had nothing to do with the moving slots).
        client = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.hosts],
            ssl=target.tls, retry=retry, reinitialize_steps=0, **auth, **common)
        return client, "cluster"
    sentinel = Sentinel(
        list(target.hosts), sentinel_kwargs={**common, **(auth if target.sentinel_auth else {})},
        ssl=target.tls, db=target.db, retry=retry, **auth, **common)
    return sentinel.master_for(target.service), "sentinel"


__all__ = ["RedisTarget", "Topology", "connect", "parse_redis_url"]
