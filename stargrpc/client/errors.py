"""Errors the client raises.

Hierarchy::

    ClientError
    ├── CallError       the server refused the call (a gRPC status with its rich details)
    ├── ResumeError     a broken stream could not be resumed without a gap
    └── ToolRunError    Result.raise_for_outcome() on an outcome other than OK (defined
                        beside Result in :mod:`stargrpc.client.events`)

A run that ends badly is *not* an exception: it is a Result with an outcome. Only
``raise_for_outcome()`` turns it into one, on request.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class ClientError(Exception):
    """Base of every error the client raises on purpose."""


@dataclass(frozen=True)
class Violation:
    """One bad field of a request, from ``google.rpc.BadRequest``."""

    field: str
    description: str


class CallError(ClientError):
    """A call ended with a gRPC status other than OK.

    Attributes:
        code: The gRPC status code.
        message: The status message.
        reason: ``google.rpc.ErrorInfo.reason`` (for example ``"CATALOG_STALE"``,
            ``"TOOL_NOT_FOUND"``); empty when the server sent none.
        metadata: ``google.rpc.ErrorInfo.metadata``.
        violations: The bad fields from ``google.rpc.BadRequest``.
        retry_delay: Seconds to wait from ``google.rpc.RetryInfo``, when the server sent it.
    """

    code: grpc.StatusCode
    message: str
    reason: str
    metadata: dict[str, str]
    violations: list[Violation]
    retry_delay: float | None

    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str = "",
                 metadata: dict[str, str] | None = None,
                 violations: list[Violation] | None = None,
                 retry_delay: float | None = None) -> None:
        shown = f"{code.name}: {message}"
        if reason:
            shown += f" [{reason}]"
        super().__init__(shown)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.violations = list(violations or [])
        self.retry_delay = retry_delay

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> CallError:
        """Reads the code, message and rich details (ErrorInfo, BadRequest, RetryInfo) of a
        failed call."""
        if not isinstance(error, grpc.Call | grpc.aio.AioRpcError):
            return cls(grpc.StatusCode.UNKNOWN, str(error))
        code = error.code() or grpc.StatusCode.UNKNOWN
        message = error.details() or ""
        # Details that do not read (inconsistent with the status, or not a google.rpc
        # Status at all: a proxy's, a damaged trailer) are left out, one by one; the code
        # and message still say what happened.
        try:
            status = rpc_status.from_call(error)
        except (ValueError, DecodeError):
            status = None
        reason, metadata, violations, retry_delay = "", {}, [], None
        for detail in status.details if status is not None else ():
            try:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    reason, metadata = info.reason, dict(info.metadata)
                elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    detail.Unpack(bad)
                    violations = [Violation(v.field, v.description)
                                  for v in bad.field_violations]
                elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    retry = error_details_pb2.RetryInfo()
                    detail.Unpack(retry)
                    retry_delay = retry.retry_delay.ToNanoseconds() / 1e9
            except (ValueError, DecodeError):
                continue
        return cls(code, message, reason=reason, metadata=metadata, violations=violations,
                   retry_delay=retry_delay)


class ResumeError(ClientError):
    """A broken stream could not be resumed: the run is gone (a restarted server, expired
    retention) or the server's log would skip events. ``last_seq`` is the last event seen.
    """

    def __init__(self, message: str, *, run_id: str, last_seq: int) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.last_seq = last_seq
