"""The record of one call attempt, shared along the interceptor chain.

The outermost interceptor (audit) opens a :class:`CallRecord` in :data:`current_call`;
authentication fills in the principal (or marks the call unauthenticated), the runtime fills
in the tool, run id and arguments, and the run fills in the outcome. When the call ends the
audit interceptor writes the record. Everyone writes into the same object, so nothing
depends on context variables flowing back out of an inner interceptor.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stargrpc.principal import Principal

if TYPE_CHECKING:
    from stargrpc.runs.run import Run
    from stargrpc.v1 import events_pb2


@dataclass
class CallRecord:
    """What is known about one call attempt so far.

    Attributes:
        method: Full gRPC method name, e.g. "/stargrpc.v1.ToolService/Execute".
        peer: The peer address as gRPC reports it.
        started: ``time.monotonic()`` at the start of the call.
        principal: The authenticated caller, once known.
        tool: Tool name, for Execute.
        run_id: The run started (or attached to) by the call.
        parent_run_id: The run the started run hangs under; empty for a top-level run.
        root_run_id: The root of the started run's call tree (its own id at the top).
        run: The run the call started in this process (the audit reads the tool's
            ``ctx.audit_view`` substitutions from it).
        arguments: The arguments as the audit should see them (the tool may substitute).
        result_view: What the audit shows as the result, when the tool substitutes it.
        idempotency_key: The request's idempotency key.
        privileged: Whether the tool is privileged.
        outcome: ok, denied, failed, error, timeout, cancelled, unauthenticated or invalid.
        detail: A short, user-safe detail.
        extra: Anything else an interceptor wants to keep with the record.
        before_result: Awaited with the run events that end with an Execute's Result
            (its batch, after the notices that ended the batches before it), before the
            caller can see the Result (the audit commits the record
            there, so every Result seen has its record stored).
    """

    method: str
    peer: str = ""
    started: float = field(default_factory=time.monotonic)
    principal: Principal | None = None
    tool: str = ""
    run_id: str = ""
    parent_run_id: str = ""
    root_run_id: str = ""
    run: Run | None = None
    arguments: dict[str, Any] | None = None
    result_view: str | None = None
    idempotency_key: str = ""
    privileged: bool = False
    outcome: str = ""
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    before_result: Callable[[Sequence[events_pb2.RunEvent]], Awaitable[None]] | None = None


#: The record of the call being served, when an interceptor opened one.
current_call: ContextVar[CallRecord | None] = ContextVar("stargrpc_call", default=None)
