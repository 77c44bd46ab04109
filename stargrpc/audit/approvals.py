"""The audit facts of approval requests: one record when a run asks for approval, one when
its request times out or is withdrawn (the run ended while it waited).

A decision is the audit record of its ApproveRun call (the approver, the digest and the
reason in ``detail``). These records are written by the server, not by a call: method
:data:`~stargrpc.runs.approval.APPROVAL_METHOD`, the principal whose run waits, the run id
and tool, the arguments as the audit shows them, and in ``detail`` what happened with the
digest of the arguments the request binds to.
"""

from __future__ import annotations

from collections.abc import Callable

from stargrpc.audit.record import AuditRecord, utc_now
from stargrpc.audit.redact import scrub_and_cut
from stargrpc.audit.view import MAX_DETAIL_CHARS
from stargrpc.audit.writer import AuditWriter
from stargrpc.ids import new_id
from stargrpc.runs.approval import APPROVAL_METHOD, ApprovalFact

#: The outcome and the words of the record of each step.
_STEPS = {
    "requested": ("ok", "approval requested"),
    "timed_out": ("denied", "approval timed out: nobody decided"),
    "withdrawn": ("cancelled", "approval request withdrawn"),
}


def approval_auditor(writer: AuditWriter) -> Callable[[ApprovalFact], None]:
    """An :attr:`Approvals.on_audit <stargrpc.runs.approval.Approvals.on_audit>` callback
    that records each step in the trail.

    Args:
        writer: The audit writer of the server.
    """

    def record(fact: ApprovalFact) -> None:
        request = fact.record
        outcome, words = _STEPS[fact.event]
        detail = (f"{words} (approval id {request.approval_id[:8]}…, arguments sha256 "
                  f"{request.digest})")
        if fact.event != "requested" and request.reason:
            detail += f": {request.reason}"
        writer.submit(AuditRecord(
            id=new_id(), time=utc_now(), method=APPROVAL_METHOD, principal=request.owner,
            tool=request.tool, run_id=request.run_id, arguments=request.arguments,
            outcome=outcome, detail=scrub_and_cut(detail, MAX_DETAIL_CHARS)))

    return record
