"""Errors of stargrpc and their one mapping to gRPC statuses.

Hierarchy::

    StargrpcError
    ├── RequestError            refused before a run starts; becomes a gRPC status
    │   ├── InvalidArgument         INVALID_ARGUMENT + google.rpc.BadRequest
    │   ├── Unauthenticated         UNAUTHENTICATED (no detail that helps an attacker)
    │   │   └── CredentialsRejected     why, for the server log only
    │   ├── PermissionDenied        PERMISSION_DENIED + google.rpc.ErrorInfo
    │   ├── NotFound                NOT_FOUND + google.rpc.ErrorInfo (unknown tool, run)
    │   ├── FailedPrecondition      FAILED_PRECONDITION + google.rpc.ErrorInfo
    │   │   ├── CatalogStale            reason CATALOG_STALE
    │   │   └── IdempotencyKeyReused    reason IDEMPOTENCY_KEY_REUSED
    │   ├── ResourceExhausted       RESOURCE_EXHAUSTED + google.rpc.RetryInfo
    │   ├── Unavailable             UNAVAILABLE (draining, a backing store down)
    │   ├── Aborted                 ABORTED + google.rpc.ErrorInfo
    │   │   └── WatcherTooSlow          a watcher fell behind; resume from a seq
    │   ├── Internal                INTERNAL: the server's own fault (details logged only)
    │   └── OutOfRange              OUT_OF_RANGE + google.rpc.ErrorInfo
    │       └── RunFinished             WatchRun past the Result of a finished run
    ├── ToolDefinitionError     a tool module is broken; stops start-up
    ├── CriticConfigError       a configured critic cannot be loaded; stops start-up
    ├── AuthConfigError         authentication is misconfigured; stops start-up
    │   └── KeysFileError           the API keys file is unreadable, or a keys command is wrong
    ├── MissingExtra            a feature of an extra not installed (``stargrpc[mcp]``)
    └── ToolOutcomeError        raised *by a tool* to end its run with an outcome
        ├── ToolFailed              Result{OUTCOME_FAILED}
        └── ToolDenied              Result{OUTCOME_DENIED}

Anything else a tool raises becomes Result{OUTCOME_ERROR} with a user-safe message; the
traceback goes to the server log only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from stargrpc.contract import reason_name
from stargrpc.v1 import errors_pb2

#: The ErrorInfo domain of every error this service reports.
__all__ = [
    "ERROR_DOMAIN",
    "Aborted",
    "AuthConfigError",
    "CatalogStale",
    "CredentialsRejected",
    "CriticConfigError",
    "FailedPrecondition",
    "FieldViolation",
    "IdempotencyKeyReused",
    "Internal",
    "InvalidArgument",
    "KeysFileError",
    "MissingExtra",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "RequestError",
    "ResourceExhausted",
    "RunFinished",
    "StargrpcError",
    "ToolDefinitionError",
    "ToolDenied",
    "ToolFailed",
    "ToolOutcomeError",
    "Unauthenticated",
    "Unavailable",
    "WatcherTooSlow",
    "reason_name",
]

ERROR_DOMAIN = "stargrpc"


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


class StargrpcError(Exception):
    """Base of every error stargrpc raises on purpose."""


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request: where (a dotted path) and why."""

    field: str
    description: str


class RequestError(StargrpcError):
    """A request refused before any run started; maps to a gRPC status with details."""

    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    reason: str = reason_name(errors_pb2.INVALID_REQUEST)

    def __init__(self, message: str, *, reason: str | None = None,
                 metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata = dict(metadata or {})

    def details(self) -> list[object]:
        """The google.rpc detail messages attached to the status."""
        return [error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN,
                                            metadata=self.metadata)]

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """Ends the call being served with this error's status; never returns."""
        status = self.to_status()
        await context.abort(status.code, status.details, status.trailing_metadata)

    def to_status(self) -> grpc.Status:
        """The gRPC status (code, message, rich details in trailing metadata)."""
        packed = []
        for detail in self.details():
            container = any_pb2.Any()
            container.Pack(detail)
            packed.append(container)
        status = status_pb2.Status(code=_CODE_NUMBERS[self.code], message=self.message,
                                   details=packed)
        return rpc_status.to_status(status)


class InvalidArgument(RequestError):
    """The request is malformed; each bad field is named."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = reason_name(errors_pb2.INVALID_ARGUMENT)

    def __init__(self, message: str, violations: Sequence[FieldViolation] = ()) -> None:
        super().__init__(message)
        self.violations = list(violations)

    def details(self) -> list[object]:
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in self.violations
        ])
        return [bad, *super().details()]


class Unauthenticated(RequestError):
    """No valid credentials. The message stays generic on purpose."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = reason_name(errors_pb2.UNAUTHENTICATED)

    def details(self) -> list[object]:
        return []


class CredentialsRejected(Unauthenticated):
    """Credentials were missing, malformed, unknown, expired or revoked. ``cause`` says which
    for the server log and metrics; the caller only ever sees the same generic message."""

    def __init__(self, cause: str) -> None:
        super().__init__("missing or invalid credentials")
        self.cause = cause


class PermissionDenied(RequestError):
    """The caller is known but may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = reason_name(errors_pb2.PERMISSION_DENIED)


class NotFound(RequestError):
    """The named tool or run does not exist (for this caller)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = reason_name(errors_pb2.NOT_FOUND)


class FailedPrecondition(RequestError):
    """The request is well-formed but the system is not in a state to serve it."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = reason_name(errors_pb2.FAILED_PRECONDITION)


class CatalogStale(FailedPrecondition):
    """The caller planned with an old catalog; it should reload and retry once."""

    reason = reason_name(errors_pb2.CATALOG_STALE)


class IdempotencyKeyReused(FailedPrecondition):
    """The idempotency key was first used for another tool or other arguments."""

    reason = reason_name(errors_pb2.IDEMPOTENCY_KEY_REUSED)


class ResourceExhausted(RequestError):
    """A limit was hit; the caller may retry after ``retry_after`` seconds."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = reason_name(errors_pb2.RESOURCE_EXHAUSTED)

    def __init__(self, message: str, *, retry_after: float = 1.0, reason: str | None = None,
                 metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.retry_after = retry_after

    def details(self) -> list[object]:
        return [_retry_info(self.retry_after), *super().details()]


class Unavailable(RequestError):
    """The server cannot take the call now (draining, a backing store is down); with
    ``retry_after``, the caller may retry after that many seconds (RetryInfo)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = reason_name(errors_pb2.UNAVAILABLE)

    def __init__(self, message: str, *, retry_after: float | None = None,
                 reason: str | None = None, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.retry_after = retry_after

    def details(self) -> list[object]:
        if self.retry_after is None:
            return super().details()
        return [*super().details(), _retry_info(self.retry_after)]


class Aborted(RequestError):
    """The call was cut short; the caller may retry it (ErrorInfo says how)."""

    code = grpc.StatusCode.ABORTED
    reason = reason_name(errors_pb2.ABORTED)


class WatcherTooSlow(Aborted):
    """A WatchRun stream fell too far behind its live run; resume from ``resume_after``."""

    reason = reason_name(errors_pb2.WATCHER_TOO_SLOW)

    def __init__(self, run_id: str, resume_after: int, lag: int) -> None:
        super().__init__(
            f"the watcher fell {lag} events behind run {run_id}; resume with WatchRun "
            f"after_seq={resume_after}",
            metadata={"run_id": run_id, "resume_after_seq": str(resume_after)})
        self.resume_after = resume_after


class Internal(RequestError):
    """A fault of the server's own while serving a request (the log has it; the caller is
    told no more than that, never the exception's text)."""

    code = grpc.StatusCode.INTERNAL
    reason = reason_name(errors_pb2.INTERNAL)


class OutOfRange(RequestError):
    """The request asks for something past the end of what exists."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = reason_name(errors_pb2.OUT_OF_RANGE)


class RunFinished(OutOfRange):
    """WatchRun asked for the events after ``after_seq`` of a run that has ended at or before
    it: there are none, and there never will be. The watcher has seen the whole run; its
    ErrorInfo metadata holds ``run_id``, ``last_seq`` (the Result's seq) and ``outcome``
    (the Result's ``Outcome`` value name, such as ``OUTCOME_OK``)."""

    reason = reason_name(errors_pb2.RUN_FINISHED)

    def __init__(self, run_id: str, after_seq: int, last_seq: int, outcome: str) -> None:
        super().__init__(
            f"run {run_id} has ended: its Result is event {last_seq}, so nothing follows "
            f"seq {after_seq}",
            metadata={"run_id": run_id, "last_seq": str(last_seq), "outcome": outcome})
        self.last_seq = last_seq
        self.outcome = outcome


class ToolDefinitionError(StargrpcError):
    """A tool module or tool definition is broken; start-up stops with this message."""


class CriticConfigError(StargrpcError):
    """A configured critic (``critic``, ``critic_url``, ``@tool(critic=…)``) cannot be
    loaded; start-up stops with this message."""


class MissingExtra(StargrpcError):
    """A feature was asked for whose optional dependencies are not installed (the MCP
    endpoint, ``mcp-stdio`` or ``mcp_servers`` without ``stargrpc[mcp]``); start-up, or
    the command, stops with this message, which names what to install."""


class AuthConfigError(StargrpcError):
    """Authentication is misconfigured (an unusable JWT key, a broken keys file)."""


class KeysFileError(AuthConfigError):
    """The API keys file cannot be read or written, or a keys command got bad input."""


class ToolOutcomeError(StargrpcError):
    """Raised by a tool to end its run with a specific outcome and a user-safe message."""

    outcome_name = "FAILED"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # TOOL_FAILED or TOOL_DENIED (ErrorReason.Value fails on a code it does not have).
        default = errors_pb2.ErrorReason.Value(f"TOOL_{self.outcome_name}")
        self.code = code or reason_name(default)


class ToolFailed(ToolOutcomeError):
    """The tool ran and could not do what was asked (Result{OUTCOME_FAILED})."""

    outcome_name = "FAILED"


class ToolDenied(ToolOutcomeError):
    """The tool, or a system behind it, refused the caller (Result{OUTCOME_DENIED})."""

    outcome_name = "DENIED"


_CODE_NUMBERS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: code_pb2.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED: code_pb2.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: code_pb2.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND: code_pb2.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: code_pb2.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED: code_pb2.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: code_pb2.UNAVAILABLE,
    grpc.StatusCode.ABORTED: code_pb2.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE: code_pb2.OUT_OF_RANGE,
    grpc.StatusCode.INTERNAL: code_pb2.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED: code_pb2.UNIMPLEMENTED,
}
