"""The contract's names that the generated code does not spell out.

What both sides of a call share beyond the messages of ``stargrpc.v1``: the service's full
name, how a run may end (:class:`Outcome`), and how an error reason is spelled on the wire.
It depends on the generated contract only, so the client SDK and the server can both use it
without either loading the other.
"""

from __future__ import annotations

import enum

from stargrpc.v1 import errors_pb2, tool_service_pb2

__all__ = ["SERVICE_NAME", "Outcome", "reason_name"]

#: The full name of the tool service, as its methods' paths spell it (``/NAME/Execute``).
SERVICE_NAME: str = tool_service_pb2.DESCRIPTOR.services_by_name["ToolService"].full_name


class Outcome(enum.Enum):
    """How a run ended; mirrors the contract's Outcome enum."""

    OK = 1
    DENIED = 2
    FAILED = 3
    ERROR = 4
    TIMEOUT = 5
    CANCELLED = 6


def reason_name(value: int) -> str:
    """The string sent for an ErrorReason value (in ErrorInfo.reason, ResultError.code,
    Notice.code): its name, as every language's generated code spells it."""
    return errors_pb2.ErrorReason.Name(value)
