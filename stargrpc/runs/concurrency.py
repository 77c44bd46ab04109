"""Concurrency limits: runs in flight globally, per principal and per tool.

A call over a limit is refused before it runs with RESOURCE_EXHAUSTED carrying
``google.rpc.RetryInfo`` (when to retry) and ErrorInfo naming the limit. Limits count the
runs of this replica: a fleet of N replicas admits up to N times as many.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stargrpc.errors import ResourceExhausted


@dataclass
class Permit:
    """One admitted run's place under the limits; release it when the run ends."""

    limits: ConcurrencyLimits
    principal: str
    tool: str
    released: bool = field(default=False)

    def release(self) -> None:
        """Frees the place (once; later calls do nothing)."""
        if not self.released:
            self.released = True
            self.limits._release(self)


class ConcurrencyLimits:
    """Counts runs in flight and refuses new ones over a limit (0 means unlimited).

    Attributes:
        total: Runs in flight at most.
        per_principal: Runs in flight per principal at most.
        per_tool: Runs in flight per tool at most.
        retry_after: Seconds suggested in RetryInfo.
    """

    total: int
    per_principal: int
    per_tool: int
    retry_after: float
    _in_flight: int
    # Plain dicts, not Counters: a Counter answers a missing name through a method written
    # in Python, and every run looks up (and drops) its principal's and tool's count.
    _by_principal: dict[str, int]
    _by_tool: dict[str, int]

    def __init__(self, total: int = 0, per_principal: int = 0, per_tool: int = 0, *,
                 retry_after: float = 1.0) -> None:
        self.total = total
        self.per_principal = per_principal
        self.per_tool = per_tool
        self.retry_after = retry_after
        self._in_flight = 0
        self._by_principal = {}
        self._by_tool = {}

    @property
    def in_flight(self) -> int:
        """Runs holding a permit."""
        return self._in_flight

    def acquire(self, principal: str, tool: str) -> Permit:
        """A permit for one run of ``tool`` by ``principal``.

        Raises:
            ResourceExhausted: A limit is reached; ErrorInfo metadata names it.
        """
        if self.total and self._in_flight >= self.total:
            self._refuse("server", self.total, "the server")
        by_principal = self._by_principal
        by_tool = self._by_tool
        if self.per_principal and by_principal.get(principal, 0) >= self.per_principal:
            self._refuse("principal", self.per_principal, "this caller")
        if self.per_tool and by_tool.get(tool, 0) >= self.per_tool:
            self._refuse("tool", self.per_tool, f"tool {tool!r}")
        self._in_flight += 1
        # Counted only where a limit needs the count (the limits are fixed).
        if self.per_principal:
            by_principal[principal] = by_principal.get(principal, 0) + 1
        if self.per_tool:
            by_tool[tool] = by_tool.get(tool, 0) + 1
        return Permit(self, principal, tool)

    def _refuse(self, scope: str, limit: int, who: str) -> None:
        raise ResourceExhausted(
            f"too many runs in flight for {who} (limit {limit}); retry after "
            f"{self.retry_after:g} s",
            retry_after=self.retry_after, reason="CONCURRENCY_LIMIT",
            metadata={"scope": scope, "limit": str(limit)})

    def _release(self, permit: Permit) -> None:
        self._in_flight -= 1
        if self.per_principal:
            _uncount(self._by_principal, permit.principal)
        if self.per_tool:
            _uncount(self._by_tool, permit.tool)


def _uncount(counts: dict[str, int], name: str) -> None:
    # Drop zero counts so a stream of distinct principals does not grow the maps.
    left = counts.get(name, 0) - 1
    if left > 0:
        counts[name] = left
    else:
        counts.pop(name, None)
