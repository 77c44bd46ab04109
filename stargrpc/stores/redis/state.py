"""Run state in Redis (``ctx.state``): :class:`RedisStateStore`.

Keys (under ``redis_key_prefix``; ``{S}`` is the scope key — ``run:<id>``, ``tree:<root
id>``, ``principal:<id>``, ``global`` — as a hash tag, so a scope's keys share one slot and a
Redis Cluster runs each script on them atomically)::

    state:{S}        hash    key → value (canonical JSON)
    state:{S}:exp    hash    key → expiry of an entry with a TTL (ms, Redis's clock)
    state:{S}:bytes  string  bytes of keys and values the scope holds (the quota's count)

Every write is one script, so compare_and_set, increment and the quota's count are atomic
however many replicas write: two replicas' compare_and_set on one key, one wins. An entry's
TTL is kept in the ``exp`` hash (per-field TTLs need Redis 7.4) and honoured by every
script: an expired entry reads as absent and is dropped when touched, and all expired
entries of a scope when a write would otherwise exceed its quota. The state of a run or tree
expires with its keys: each write pushes their TTL out to a bound while it runs, and its end
sets it to ``state_retention_seconds`` (:meth:`RedisStateStore.end_scope`).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from stargrpc.stores.base import StateWrite
from stargrpc.stores.redis.errors import reachable
from stargrpc.stores.redis.scripts import NOW_MS

# Shared by the scripts: KEYS = data, exp, bytes. live(f) is the value of a field that has
# not expired (an expired one is dropped and uncounted); write() sets a field within the
# quota; touch() pushes out the scope's TTL.
_COMMON = NOW_MS + """
local now = now_ms()
local function live(f)
  local e = redis.call('HGET', KEYS[2], f)
  local v = redis.call('HGET', KEYS[1], f)
  if e and tonumber(e) <= now then
    if v then redis.call('DECRBY', KEYS[3], #f + #v) end
    redis.call('HDEL', KEYS[1], f)
    redis.call('HDEL', KEYS[2], f)
    return false
  end
  return v
end
local function write(f, old, v, ttl_ms, max_bytes, scope_ttl_ms)
  local grows = #f + #v
  if old then grows = grows - #f - #old end
  if max_bytes > 0 and grows > 0 then
    local size = tonumber(redis.call('GET', KEYS[3]) or '0')
    if size + grows > max_bytes then
      local exp = redis.call('HGETALL', KEYS[2])
      for i = 1, #exp, 2 do
        if tonumber(exp[i + 1]) <= now then live(exp[i]) end
      end
      size = tonumber(redis.call('GET', KEYS[3]) or '0')
      if size + grows > max_bytes then return 'quota' end
    end
  end
  redis.call('HSET', KEYS[1], f, v)
  if ttl_ms > 0 then
    redis.call('HSET', KEYS[2], f, now + ttl_ms)
  else
    redis.call('HDEL', KEYS[2], f)
  end
  redis.call('INCRBY', KEYS[3], grows)
  if scope_ttl_ms > 0 then
    for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], scope_ttl_ms) end
  end
  return 'written'
end
"""

# ARGV: key, value, conditional (1/0), expected present (1/0), expected, ttl_ms, max_bytes,
# scope_ttl_ms. Returns written | mismatch | quota.
PUT = _COMMON + """
local old = live(ARGV[1])
if ARGV[3] == '1' then
  if ARGV[4] == '1' then
    if old ~= ARGV[5] then return 'mismatch' end
  elseif old then
    return 'mismatch'
  end
end
return write(ARGV[1], old, ARGV[2], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]))
"""

# ARGV: key, by, ttl_ms, max_bytes, scope_ttl_ms. Returns {'ok', new value} | {'not_integer'}
# | {'quota'}. Integers stay within 2^53, where Lua's numbers are exact.
INCREMENT = _COMMON + """
local old = live(ARGV[1])
local n = 0
if old then
  if not string.match(old, '^-?%d+$') then return {'not_integer'} end
  n = tonumber(old)
end
n = n + tonumber(ARGV[2])
if n > 9007199254740991 or n < -9007199254740991 then return {'not_integer'} end
local v = string.format('%.0f', n)
local done = write(ARGV[1], old, v, tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]))
if done ~= 'written' then return {done} end
return {'ok', v}
"""

GET = _COMMON + """
return live(ARGV[1])
"""

DELETE = _COMMON + """
local old = live(ARGV[1])
if not old then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[3], #ARGV[1] + #old)
return 1
"""

# ARGV: prefix. The live keys with it.
KEYS_WITH = _COMMON + """
local found = {}
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(f, 1, #ARGV[1]) == ARGV[1] and live(f) then table.insert(found, f) end
end
return found
"""

END = """
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
return 1
"""


class RedisStateStore:
    """Run state shared by a fleet's replicas (the :class:`~stargrpc.stores.base.StateStore`
    of a server with ``redis_url``); see the module for the layout."""

    def __init__(self, redis: Redis | RedisCluster, *, prefix: str = "stargrpc:") -> None:
        """
        Args:
            redis: The client (one Redis or a cluster).
            prefix: Prefix of every key.
        """
        self._redis = redis
        self._prefix = prefix
        self._put = redis.register_script(PUT)
        self._increment = redis.register_script(INCREMENT)
        self._get = redis.register_script(GET)
        self._delete = redis.register_script(DELETE)
        self._keys = redis.register_script(KEYS_WITH)
        self._end = redis.register_script(END)

    def scope_keys(self, scope: str) -> list[str]:
        """The keys of ``scope``: data, exp, bytes — one hash tag, one slot."""
        data = f"{self._prefix}state:{{{scope}}}"
        return [data, f"{data}:exp", f"{data}:bytes"]

    async def _call(self, script: Any, scope: str, args: list[Any], action: str) -> Any:
        with reachable(action):
            return await script(keys=self.scope_keys(scope), args=args)

    async def get(self, scope: str, key: str) -> str | None:
        value = await self._call(self._get, scope, [key], "read run state")
        return None if value is None else _text(value)

    async def put(self, scope: str, key: str, value: str, write: StateWrite, *,
                  conditional: bool = False, expected: str | None = None) -> str:
        answer = await self._call(self._put, scope, [
            key, value, int(conditional), int(expected is not None), expected or "",
            write.ttl_ms, write.max_scope_bytes, write.scope_ttl_ms], "write run state")
        return _text(answer)

    async def increment(self, scope: str, key: str, by: int,
                        write: StateWrite) -> int | str:
        answer = await self._call(self._increment, scope, [
            key, by, write.ttl_ms, write.max_scope_bytes, write.scope_ttl_ms],
            "write run state")
        status = _text(answer[0])
        return int(_text(answer[1])) if status == "ok" else status

    async def delete(self, scope: str, key: str) -> bool:
        return bool(await self._call(self._delete, scope, [key], "write run state"))

    async def keys(self, scope: str, prefix: str) -> list[str]:
        found = await self._call(self._keys, scope, [prefix], "read run state")
        return sorted(_text(key) for key in found)

    async def end_scope(self, scope: str, retention_ms: int) -> None:
        await self._call(self._end, scope, [max(1, retention_ms)], "end run state")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

