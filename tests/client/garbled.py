"""A server whose refusals carry google.rpc details that do not read, as a proxy or a damaged
trailer could send them: the clients must still report the code and the message."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

#: ``grpc-status-details-bin`` values: a Status cut short, and a whole Status whose
#: ErrorInfo does not read but whose BadRequest does.
TRUNCATED = b"\x12\xff"
BAD_ERROR_INFO = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message="nope",
                                   details=[
    any_pb2.Any(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\x0a\xff\xff"),
    any_pb2.Any(type_url="type.googleapis.com/google.rpc.BadRequest",
                value=error_details_pb2.BadRequest(field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field="tool_name", description="unknown")]).SerializeToString()),
]).SerializeToString()


@contextlib.asynccontextmanager
async def garbled_server(details: bytes) -> AsyncIterator[str]:
    """A server on 127.0.0.1 whose ListTools is refused NOT_FOUND "nope" with ``details``
    as its ``grpc-status-details-bin``; yields its target."""
    async def list_tools(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "nope",
                            trailing_metadata=(("grpc-status-details-bin", details),))
        raise AssertionError("abort raises")  # pragma: no cover

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "stargrpc.v1.ToolService",
        {"ListTools": grpc.unary_unary_rpc_method_handler(list_tools)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
