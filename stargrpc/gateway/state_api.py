"""The gateway's run state routes: RunStateService over HTTP, for operators (admin role,
audited, as over gRPC: the gateway forwards the caller's credentials)::

    GET    /v1/state/{scope}?run_id=&principal=&prefix=&page_size=&after_key=&with_values=
           → {"entries": [{"key", "value"?}], "next_after_key"}
    GET    /v1/state/{scope}/{key}?run_id=&principal=   → {"found": bool, "value"?}
    PUT    /v1/state/{scope}/{key}?run_id=&principal=   body {"value": …, "ttl_seconds"?}
    DELETE /v1/state/{scope}/{key}?run_id=&principal=   → {"deleted": bool}

``scope`` is ``run``, ``tree``, ``principal`` or ``global``; refusals are the HTTP form of the
gRPC status (403 PERMISSION_DENIED, 400 with the field and the STATE_* reason, …).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stargrpc.gateway.client import GatewayClient
from stargrpc.gateway.http_errors import MalformedRequest, error_body, rpc_error_response
from stargrpc.v1 import state_pb2

Metadata = tuple[tuple[str, str], ...]

_SCOPES = {"run": state_pb2.STATE_SCOPE_RUN, "tree": state_pb2.STATE_SCOPE_TREE,
           "principal": state_pb2.STATE_SCOPE_PRINCIPAL,
           "global": state_pb2.STATE_SCOPE_GLOBAL}


class SetStateBody(BaseModel):
    """The JSON body of ``PUT /v1/state/{scope}/{key}``."""

    model_config = ConfigDict(extra="forbid")

    value: Any
    ttl_seconds: float = 0.0


class BodyRefused(Exception):
    """The request's body could not be read (too large, not JSON): answer ``response``."""

    def __init__(self, response: Response) -> None:
        super().__init__("the body was refused")
        self.response = response


class _Refused(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message

    def response(self) -> JSONResponse:
        detail = {"@type": "type.googleapis.com/google.rpc.BadRequest",
                  "fieldViolations": [{"field": self.field, "description": self.message}]}
        return MalformedRequest(error_body(400, "INVALID_ARGUMENT", self.message, [detail]),
                                status_code=400)


class StateApi:
    """The run state routes of one gateway."""

    def __init__(self, client: GatewayClient, metadata: Callable[[Request], Any],
                 json_body: Callable[[Request], Awaitable[Any]]) -> None:
        """
        Args:
            client: The gateway's gRPC client.
            metadata: The call metadata of an HTTP request (its credentials, its client).
            json_body: Reads a request's JSON body (bounded), or raises
                :class:`BodyRefused`.
        """
        self._client = client
        self._metadata = metadata
        self._json_body = json_body

    @property
    def routes(self) -> list[Route]:
        """The routes to mount."""
        return [Route("/v1/state/{scope}", self.list_state, methods=["GET"]),
                Route("/v1/state/{scope}/{key}", self.get_state, methods=["GET"]),
                Route("/v1/state/{scope}/{key}", self.set_state, methods=["PUT"]),
                Route("/v1/state/{scope}/{key}", self.delete_state, methods=["DELETE"])]

    async def list_state(self, request: Request) -> Response:
        """``GET /v1/state/{scope}``: ListState."""

        async def send(scope: state_pb2.StateScopeRef) -> dict[str, Any]:
            params = request.query_params
            size = params.get("page_size", "0")
            if not (size.isdigit() and len(size) <= 4):
                raise _Refused("page_size", "a whole number from 0 to 1000")
            reply = await self._client.state_stub.ListState(state_pb2.ListStateRequest(
                scope=scope, prefix=params.get("prefix", ""), page_size=int(size),
                after_key=params.get("after_key", ""),
                with_values=params.get("with_values", "").lower() in ("1", "true", "yes")),
                metadata=self._metadata(request))
            entries = [{"key": e.key, **({"value": json.loads(e.value_json)}
                                         if e.value_json else {})} for e in reply.entries]
            return {"entries": entries, "next_after_key": reply.next_after_key}

        return await self._answer(request, send)

    async def get_state(self, request: Request) -> Response:
        """``GET /v1/state/{scope}/{key}``: GetState."""

        async def send(scope: state_pb2.StateScopeRef) -> dict[str, Any]:
            reply = await self._client.state_stub.GetState(state_pb2.GetStateRequest(
                scope=scope, key=request.path_params["key"]),
                metadata=self._metadata(request))
            if not reply.found:
                return {"found": False}
            return {"found": True, "value": json.loads(reply.value_json)}

        return await self._answer(request, send)

    async def set_state(self, request: Request) -> Response:
        """``PUT /v1/state/{scope}/{key}``: SetState."""

        async def send(scope: state_pb2.StateScopeRef) -> dict[str, Any]:
            try:
                body = SetStateBody.model_validate(await self._json_body(request))
            except ValidationError as exc:
                first = exc.errors()[0]
                raise _Refused(".".join(str(p) for p in first["loc"]) or "body",
                               first["msg"]) from None
            try:
                value_json = json.dumps(body.value, allow_nan=False)
            except ValueError as exc:
                raise _Refused("value", f"not JSON: {exc}") from None
            await self._client.state_stub.SetState(state_pb2.SetStateRequest(
                scope=scope, key=request.path_params["key"], value_json=value_json,
                ttl_seconds=body.ttl_seconds), metadata=self._metadata(request))
            return {}

        return await self._answer(request, send)

    async def delete_state(self, request: Request) -> Response:
        """``DELETE /v1/state/{scope}/{key}``: DeleteState."""

        async def send(scope: state_pb2.StateScopeRef) -> dict[str, Any]:
            reply = await self._client.state_stub.DeleteState(state_pb2.DeleteStateRequest(
                scope=scope, key=request.path_params["key"]),
                metadata=self._metadata(request))
            return {"deleted": reply.deleted}

        return await self._answer(request, send)

    async def _answer(self, request: Request,
                      send: Callable[[state_pb2.StateScopeRef], Awaitable[dict[str, Any]]]
                      ) -> Response:
        try:
            scope = _scope(request)
            return JSONResponse(await send(scope))
        except _Refused as refused:
            return refused.response()
        except BodyRefused as refused:
            return refused.response
        except grpc.aio.AioRpcError as error:
            return rpc_error_response(error)


def _scope(request: Request) -> state_pb2.StateScopeRef:
    name = request.path_params["scope"]
    if name not in _SCOPES:
        raise _Refused("scope", "one of run, tree, principal, global")
    params = request.query_params
    return state_pb2.StateScopeRef(scope=_SCOPES[name], run_id=params.get("run_id", ""),
                                   principal=params.get("principal", ""))
