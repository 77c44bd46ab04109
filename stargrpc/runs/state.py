"""Run state: what a tool keeps beyond one call, through ``ctx.state(scope)``.

A scope is a small key-value store of JSON values::

    run        this run's own                       run:<run_id>
    tree       the root run's, shared by its tree   tree:<root_run_id>
    principal  the caller's, across runs and trees  principal:<principal id>
    global     every tool's; written only by the    global
               tools the operator names in ``state_global_writers``

``run`` and ``tree`` state goes ``state_retention_seconds`` after its run (its root run)
ends; while the run goes, each write bounds it to :data:`RUNNING_BOUND_SECONDS` more.
``principal`` and ``global`` entries stay until deleted or their own ``ttl`` runs out.

Bad use is refused with a :class:`StateError` (a :class:`~stargrpc.errors.ToolFailed`: a
tool that does not catch it ends FAILED with its code), each with a stable code::

    StateError                 the base
    ├── StateBadKey            STATE_BAD_KEY          empty, too long, or a character
    │                                                 outside letters, digits, . _ -
    ├── StateValueNotJson      STATE_VALUE_NOT_JSON   not JSON (NaN, bytes, objects …)
    ├── StateValueTooLarge     STATE_VALUE_TOO_LARGE  over state_max_value_bytes
    ├── StateQuotaExceeded     STATE_QUOTA_EXCEEDED   the scope would pass
    │                                                 state_max_bytes_per_scope
    ├── StateNotInteger        STATE_NOT_INTEGER      increment of a non-integer value
    ├── StateBadScope          STATE_BAD_SCOPE        no such scope, or a bad ttl
    ├── StateUnavailable       STATE_UNAVAILABLE      the store did not answer (Redis
    │                                                 down or failing); try again later
    └── StateReadOnly          STATE_READ_ONLY        a write to global by a tool not in
                                                      state_global_writers (a ToolDenied)

Where it lives is the server's :class:`~stargrpc.stores.base.StateStore`: in memory when
embedded (lost on restart), in Redis for a fleet (:mod:`stargrpc.stores.redis.state`).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from stargrpc.errors import RequestError, ToolDenied, ToolFailed
from stargrpc.runs.arguments import nests_deeper
from stargrpc.settings import Settings
from stargrpc.stores.base import (
    STATE_NOT_INTEGER,
    STATE_OVER_QUOTA,
    STATE_WRITTEN,
    StateStore,
    StateWrite,
)

if TYPE_CHECKING:
    from stargrpc.principal import Principal

#: The scopes a tool may ask for.
SCOPES = ("run", "tree", "principal", "global")
#: How long the state of a run or tree still going outlives its last write (beyond the
#: retention): the bound for a run whose end is never seen (its replica died).
RUNNING_BOUND_SECONDS = 7 * 86400
#: Longest key, in characters.
MAX_KEY_LENGTH = 200
_KEY = re.compile(r"[A-Za-z0-9._-]+")
_BAD_CHAR = re.compile(r"[^A-Za-z0-9._-]")
#: Canonical JSON, made once: json.dumps with these options builds an encoder per call.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)
#: Largest integer increment keeps (exact in every store, Redis's Lua included).
MAX_INTEGER = 2**53 - 1

T = TypeVar("T")


class StateError(ToolFailed):
    """Run state refused a call (see the module for the codes)."""

    default_code = "STATE_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(message, code=self.default_code)


class StateBadKey(StateError):
    """The key is empty, too long, or holds a character other than letters, digits, . _ -."""

    default_code = "STATE_BAD_KEY"


class StateValueNotJson(StateError):
    """The value cannot be written as JSON."""

    default_code = "STATE_VALUE_NOT_JSON"


class StateValueTooLarge(StateError):
    """The value's JSON is larger than ``state_max_value_bytes``."""

    default_code = "STATE_VALUE_TOO_LARGE"


class StateQuotaExceeded(StateError):
    """The scope would hold more than ``state_max_bytes_per_scope``."""

    default_code = "STATE_QUOTA_EXCEEDED"


class StateNotInteger(StateError):
    """``increment`` found a value that is not an integer, or would pass 2**53 - 1."""

    default_code = "STATE_NOT_INTEGER"


class StateBadScope(StateError):
    """No such scope, or a ttl that is not a positive number of seconds."""

    default_code = "STATE_BAD_SCOPE"


class StateUnavailable(StateError):
    """The state store could not be reached, or failed (the fleet's Redis)."""

    default_code = "STATE_UNAVAILABLE"


class StateReadOnly(ToolDenied):
    """A write to ``global`` by a tool the operator did not name in
    ``state_global_writers``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="STATE_READ_ONLY")


def scope_key(scope: str, *, run_id: str, root_run_id: str, principal: Principal) -> str:
    """The store's name of ``scope`` for a run.

    Raises:
        StateBadScope: ``scope`` is none of :data:`SCOPES`.
    """
    if scope == "run":
        return f"run:{run_id}"
    if scope == "tree":
        return f"tree:{root_run_id}"
    if scope == "principal":
        return f"principal:{principal.id}"
    if scope == "global":
        return "global"
    raise StateBadScope(f"no state scope {scope!r}: use one of {', '.join(SCOPES)}")


def check_key(key: object, *, prefix: bool = False) -> str:
    """``key`` if it is a valid state key (a prefix may be empty).

    Raises:
        StateBadKey: Why it is not.
    """
    if not isinstance(key, str):
        raise StateBadKey(f"a state key is a string, not {type(key).__name__}")
    if not key and prefix:
        return key
    if not key:
        raise StateBadKey("a state key is not empty")
    if len(key) > MAX_KEY_LENGTH:
        raise StateBadKey(f"a state key has at most {MAX_KEY_LENGTH} characters, "
                          f"not {len(key)}")
    if not _KEY.fullmatch(key):
        bad = _BAD_CHAR.search(key)
        assert bad is not None
        raise StateBadKey(f"a state key holds letters, digits, '.', '_' and '-' only: "
                          f"{bad.group()!r} at position {bad.start()}")
    return key


#: How deep a state value may nest (a scalar is 1 deep, ``[1]`` 2): the readers of a value
#: — protobuf's Struct, the gateway's JSON, most clients' parsers — recurse, and the deeper
#: values Python's own parser took (some 970 levels) could be written but not read back.
MAX_VALUE_DEPTH = 64


def encode(value: Any, max_bytes: int) -> str:
    """``value`` as canonical JSON (sorted keys, no spaces: equal values, equal text).

    Raises:
        StateValueNotJson: It is not JSON, or nests deeper than :data:`MAX_VALUE_DEPTH`.
        StateValueTooLarge: Its JSON is over ``max_bytes``.
    """
    if nests_deeper(value, MAX_VALUE_DEPTH):
        raise StateValueNotJson(f"a state value nests at most {MAX_VALUE_DEPTH} levels deep")
    try:
        text = _CANONICAL.encode(value)
    except (TypeError, ValueError) as exc:
        raise StateValueNotJson(f"a state value is JSON: {exc}") from None
    try:
        size = len(text.encode())
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" decoded): no JSON text holds it
        raise StateValueNotJson("a state value is JSON: a string in it holds a lone "
                                "surrogate") from None
    if max_bytes and size > max_bytes:
        raise StateValueTooLarge(f"a state value is at most {max_bytes} bytes of JSON "
                                 f"(state_max_value_bytes), not {size}")
    return text


#: The longest ttl a state value may have (ten years): past it a ttl means "no ttl", and
#: its milliseconds would overflow what the stores take (1e308 s was an OverflowError).
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600


def _ttl_ms(ttl: float | None) -> int:
    if ttl is None:
        return 0
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or not 0 < ttl <= MAX_TTL_SECONDS:
        raise StateBadScope(f"a state ttl is a positive number of seconds up to "
                            f"{MAX_TTL_SECONDS} (ten years; none for no expiry), not {ttl!r}")
    return max(1, int(ttl * 1000))


async def _stored(call: Awaitable[T]) -> T:
    try:
        return await call
    except RequestError as exc:  # the store's own failure, already logged by it
        raise StateUnavailable(f"run state is unavailable: {exc.message}") from None


class RunState:
    """One scope of state for one run: ``await ctx.state("tree").get("seen")``.

    Attributes:
        scope: The scope asked for (``run``, ``tree``, ``principal``, ``global``).
        name: The store's name of it (``tree:<root run id>`` …).
    """

    scope: str
    name: str
    _store: StateStore
    _settings: Settings
    _writable: bool
    _scope_ttl_ms: int

    def __init__(self, store: StateStore, scope: str, name: str, settings: Settings, *,
                 writable: bool) -> None:
        self._store = store
        self.scope = scope
        self.name = name
        self._settings = settings
        self._writable = writable
        self._scope_ttl_ms = (
            int((settings.state_retention_seconds + RUNNING_BOUND_SECONDS) * 1000)
            if scope in ("run", "tree") else 0)

    def _write(self, ttl: float | None) -> StateWrite:
        if not self._writable:
            raise StateReadOnly("global state is written only by the tools the operator "
                                "names in state_global_writers")
        return StateWrite(scope_ttl_ms=self._scope_ttl_ms,
                          max_scope_bytes=self._settings.state_max_bytes_per_scope,
                          ttl_ms=_ttl_ms(ttl))

    def _quota(self) -> StateQuotaExceeded:
        return StateQuotaExceeded(
            f"the {self.scope} state would hold more than "
            f"{self._settings.state_max_bytes_per_scope} bytes (state_max_bytes_per_scope)")

    async def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when it is absent (or expired).

        Raises:
            StateBadKey: The key is not valid.
        """
        text = await _stored(self._store.get(self.name, check_key(key)))
        return default if text is None else json.loads(text)

    async def set(self, key: str, value: Any, *, ttl: float | None = None) -> None:
        """Sets ``key`` to ``value`` (JSON), for ``ttl`` seconds (None: as long as the
        scope).

        Raises:
            StateBadKey, StateValueNotJson, StateValueTooLarge, StateQuotaExceeded,
            StateBadScope (a bad ttl), StateReadOnly.
        """
        write = self._write(ttl)
        text = encode(value, self._settings.state_max_value_bytes)
        if await _stored(self._store.put(self.name, check_key(key), text, write)) \
                == STATE_OVER_QUOTA:
            raise self._quota()

    async def compare_and_set(self, key: str, expected: Any, value: Any, *,
                              ttl: float | None = None) -> bool:
        """Sets ``key`` to ``value`` only if it holds ``expected`` now (None: only if it is
        absent), atomically, also between replicas. Returns whether it was set.

        Raises:
            As :meth:`set`.
        """
        write = self._write(ttl)
        max_bytes = self._settings.state_max_value_bytes
        text = encode(value, max_bytes)
        wanted = None if expected is None else encode(expected, 0)
        outcome = await _stored(self._store.put(self.name, check_key(key), text, write,
                                                 conditional=True, expected=wanted))
        if outcome == STATE_OVER_QUOTA:
            raise self._quota()
        return outcome == STATE_WRITTEN

    async def increment(self, key: str, by: int = 1, *, ttl: float | None = None) -> int:
        """Adds ``by`` to the integer at ``key`` (absent: 0) atomically; the new value.

        Raises:
            StateNotInteger: The value there is not an integer, or the sum passes 2**53 - 1.
            As :meth:`set`.
        """
        write = self._write(ttl)
        if isinstance(by, bool) or not isinstance(by, int) or abs(by) > MAX_INTEGER:
            raise StateNotInteger(f"increment adds an integer, not {by!r}")
        outcome = await _stored(self._store.increment(self.name, check_key(key), by, write))
        if outcome == STATE_OVER_QUOTA:
            raise self._quota()
        if outcome == STATE_NOT_INTEGER or isinstance(outcome, str) \
                or abs(outcome) > MAX_INTEGER:
            raise StateNotInteger(f"state key {key!r} does not hold an integer that can "
                                  f"grow by {by} (at most {MAX_INTEGER})")
        return outcome

    async def delete(self, key: str) -> bool:
        """Removes ``key``; whether it was there.

        Raises:
            StateBadKey, StateReadOnly.
        """
        self._write(None)
        return await _stored(self._store.delete(self.name, check_key(key)))

    async def keys(self, prefix: str = "") -> list[str]:
        """The keys starting with ``prefix``, sorted.

        Raises:
            StateBadKey: The prefix holds a character a key cannot.
        """
        return await _stored(self._store.keys(self.name, check_key(prefix, prefix=True)))


class SyncRunState:
    """:class:`RunState` for a plain ``def`` tool: the same methods, blocking."""

    _state: RunState
    _loop: asyncio.AbstractEventLoop

    def __init__(self, state: RunState, loop: asyncio.AbstractEventLoop) -> None:
        self._state = state
        self._loop = loop

    @property
    def scope(self) -> str:
        """The scope asked for."""
        return self._state.scope

    def _wait(self, call: Awaitable[T]) -> T:
        async def run() -> T:
            return await call

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def get(self, key: str, default: Any = None) -> Any:
        """See :meth:`RunState.get`."""
        return self._wait(self._state.get(key, default))

    def set(self, key: str, value: Any, *, ttl: float | None = None) -> None:
        """See :meth:`RunState.set`."""
        self._wait(self._state.set(key, value, ttl=ttl))

    def compare_and_set(self, key: str, expected: Any, value: Any, *,
                        ttl: float | None = None) -> bool:
        """See :meth:`RunState.compare_and_set`."""
        return self._wait(self._state.compare_and_set(key, expected, value, ttl=ttl))

    def increment(self, key: str, by: int = 1, *, ttl: float | None = None) -> int:
        """See :meth:`RunState.increment`."""
        return self._wait(self._state.increment(key, by, ttl=ttl))

    def delete(self, key: str) -> bool:
        """See :meth:`RunState.delete`."""
        return self._wait(self._state.delete(key))

    def keys(self, prefix: str = "") -> list[str]:
        """See :meth:`RunState.keys`."""
        return self._wait(self._state.keys(prefix))


__all__ = [
    "MAX_KEY_LENGTH", "RUNNING_BOUND_SECONDS", "SCOPES", "RunState",
    "StateBadKey", "StateBadScope", "StateError", "StateNotInteger", "StateQuotaExceeded",
    "StateReadOnly", "StateUnavailable", "StateValueNotJson", "StateValueTooLarge",
    "SyncRunState",
    "check_key", "encode", "scope_key",
]
