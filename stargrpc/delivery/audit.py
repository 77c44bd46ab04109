"""The audit facts of deliveries: one record per delivery's final state.

A delivery happens after its run's Result, which is the last event of the run, so it
cannot be a notice in the run's log; it is a record of the audit trail instead (method
:data:`DELIVERY_METHOD`, the run id and tool of the run, outcome ``ok`` when delivered and
``failed`` when given up, the target and attempts in ``detail``), beside the metrics and
the log lines.
"""

from __future__ import annotations

from collections.abc import Callable

from stargrpc.audit.record import AuditRecord, utc_now
from stargrpc.audit.redact import scrub_text
from stargrpc.audit.writer import AuditWriter
from stargrpc.delivery.target import DeliveryTarget
from stargrpc.ids import new_id

#: The ``method`` of a delivery's audit record (``stargrpc audit query --method``).
DELIVERY_METHOD = "/stargrpc.delivery/Deliver"

#: Longest failure reason kept in a record's detail.
_MAX_REASON_CHARS = 300


def delivery_auditor(writer: AuditWriter
                     ) -> Callable[[str, str, DeliveryTarget, str, int, str], None]:
    """A :attr:`Deliveries.on_final` callback that records each final state in the trail.

    Args:
        writer: The audit writer of the server.
    """

    def record(run_id: str, tool: str, target: DeliveryTarget, state: str, attempts: int,
               reason: str) -> None:
        # A webhook URL may carry a token in its query: scrubbed like any audited text.
        detail = f"{target.kind} {scrub_text(target.address)}: {state} after {attempts} " \
                 f"attempt{'s' if attempts != 1 else ''}"
        if reason:
            detail += f"; {scrub_text(reason)[:_MAX_REASON_CHARS]}"
        writer.submit(AuditRecord(id=new_id(), time=utc_now(), method=DELIVERY_METHOD,
                                  tool=tool, run_id=run_id,
                                  outcome="ok" if state == "delivered" else "failed",
                                  detail=detail))

    return record
