"""gRPC statuses as HTTP errors.

The gateway answers a refused call the way Google's HTTP APIs do: the HTTP status that
matches the gRPC code, and a JSON body ``{"error": {"code", "status", "message", "details"}}``
whose ``details`` are the ``google.rpc`` detail messages of the gRPC status (ErrorInfo,
BadRequest, RetryInfo) in their JSON form. RetryInfo also becomes ``Retry-After``.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from starlette.responses import JSONResponse

from stargrpc.client.errors import CallError
from stargrpc.errors import reason_name
from stargrpc.v1 import errors_pb2

_RUN_FINISHED = reason_name(errors_pb2.RUN_FINISHED)

#: HTTP status per gRPC code (the mapping of google.rpc.Code).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}


class MalformedRequest(JSONResponse):
    """The gateway's own refusal of a request for its form (a body or query it cannot
    read), before any call to the server: told only to a caller whose credentials pass
    (see ``Gateway._credentials_first``)."""


def error_body(status: int, code_name: str, message: str,
               details: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON body of an error answer."""
    return {"error": {"code": status, "status": code_name, "message": message,
                      "details": details or []}}


def http_error(status: int, code_name: str, message: str) -> JSONResponse:
    """An error the gateway itself raises (bad JSON body, unknown route …)."""
    return JSONResponse(error_body(status, code_name, message), status_code=status)


def rpc_error_response(error: grpc.aio.AioRpcError) -> JSONResponse:
    """The HTTP answer to a failed gRPC call, with its rich details."""
    code = error.code()
    status = HTTP_STATUS.get(code, 500)
    details: list[dict[str, Any]] = []
    headers: dict[str, str] = {}
    rich = _rich_status(error)
    for packed in rich.details if rich is not None else ():
        try:
            details.append(json_format.MessageToDict(packed, preserving_proto_field_name=False))
        except TypeError:  # a detail type this process does not know: skip it
            continue
        if packed.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            packed.Unpack(info)
            seconds = info.retry_delay.ToNanoseconds() / 1e9
            headers["Retry-After"] = str(max(1, math.ceil(seconds)))
    if code is grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = 'Bearer realm="stargrpc"'
    return JSONResponse(error_body(status, code.name, error.details() or code.name.lower(),
                                   details), status_code=status, headers=headers)


def _rich_status(error: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    try:
        return rpc_status.from_call(error)
    except ValueError:  # details inconsistent with the status: show the plain status only
        return None


def is_run_finished(error: grpc.aio.AioRpcError) -> bool:
    """Whether a WatchRun failed only because it asked for events after the end of a
    finished run (OUT_OF_RANGE, ErrorInfo reason RUN_FINISHED): the end, not a failure."""
    return error.code() is grpc.StatusCode.OUT_OF_RANGE and \
        CallError.from_rpc_error(error).reason == _RUN_FINISHED
