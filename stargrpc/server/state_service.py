"""RunStateService: operators read and change run state (``ctx.state``) in any scope.

Admin role only (``admin_role``): anyone else is refused PERMISSION_DENIED before the store
is touched. The audit interceptor writes one record per call like any other; this service
fills in what it did (``state get run:<id> key``) as the record's detail and the scope and
key as its arguments, never a value. Keys, values, ttls and quotas go through the same
:class:`~stargrpc.runs.state.RunState` as a tool's, and its refusals become statuses:
INVALID_ARGUMENT (with the field and the STATE_* reason), RESOURCE_EXHAUSTED
(STATE_QUOTA_EXCEEDED), UNAVAILABLE (STATE_UNAVAILABLE).
"""

from __future__ import annotations

import json
import re
from typing import Any

import grpc

from stargrpc.errors import (
    FieldViolation,
    InvalidArgument,
    PermissionDenied,
    RequestError,
    Unavailable,
    reason_name,
)
from stargrpc.principal import current_principal
from stargrpc.runs.call_record import current_call
from stargrpc.runs.state import (
    RunState,
    StateError,
    StateQuotaExceeded,
    StateUnavailable,
    check_key,
)
from stargrpc.server.service import _tolerant, _well_formed
from stargrpc.settings import Settings
from stargrpc.stores.base import StateStore
from stargrpc.v1 import errors_pb2, state_pb2

#: The service's full name.
SERVICE_NAME = state_pb2.DESCRIPTOR.services_by_name["RunStateService"].full_name
#: Entries in a ListState page when the request says 0, and at most.
DEFAULT_PAGE = 100
MAX_PAGE = 1000
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_MAX_PRINCIPAL = 512
_SCOPE_NAMES = {state_pb2.STATE_SCOPE_RUN: "run", state_pb2.STATE_SCOPE_TREE: "tree",
                state_pb2.STATE_SCOPE_PRINCIPAL: "principal",
                state_pb2.STATE_SCOPE_GLOBAL: "global"}


def _bad(field: str, error: StateError | str, reason: str | None = None) -> InvalidArgument:
    message = error if isinstance(error, str) else error.message
    refused = InvalidArgument(message, [FieldViolation(field, message)])
    refused.reason = reason or (error.code if isinstance(error, StateError)
                                else reason_name(errors_pb2.STATE_BAD_SCOPE))
    return refused


def scope_name(ref: state_pb2.StateScopeRef) -> tuple[str, str]:
    """(scope, the store's name of it) for ``ref``.

    Raises:
        InvalidArgument: No scope, or the run or principal it needs is missing or malformed
            (reason STATE_BAD_SCOPE).
    """
    scope = _SCOPE_NAMES.get(ref.scope)
    if scope is None:
        raise _bad("scope.scope", "name a scope: run, tree, principal or global")
    if scope in ("run", "tree"):
        if not _RUN_ID.fullmatch(ref.run_id):
            raise _bad("scope.run_id", f"scope {scope} needs the id of its "
                       f"{'run' if scope == 'run' else 'root run'}: letters, digits, '.', "
                       "'_' and '-', at most 128")
        if ref.principal:
            raise _bad("scope.principal", f"scope {scope} names no principal")
        return scope, f"{scope}:{ref.run_id}"
    if ref.run_id:
        raise _bad("scope.run_id", f"scope {scope} names no run")
    if scope == "principal":
        if not ref.principal or len(ref.principal) > _MAX_PRINCIPAL or any(
                ord(c) < 32 or ord(c) == 127 for c in ref.principal):
            raise _bad("scope.principal", "scope principal needs the principal's id: at "
                       f"most {_MAX_PRINCIPAL} characters, no control characters")
        return scope, f"principal:{ref.principal}"
    if ref.principal:
        raise _bad("scope.principal", "scope global names no principal")
    return scope, "global"


class RunStateService:
    """The stargrpc.v1.RunStateService implementation."""

    _store: StateStore
    _settings: Settings

    def __init__(self, store: StateStore, settings: Settings) -> None:
        self._store = store
        self._settings = settings

    def _open(self, request: Any, action: str, key_field: str = "key") -> RunState:
        """The scope ``request`` names, for an admin; notes the call in its audit record
        first (refused calls too).

        Raises:
            InvalidArgument: The request could not be decoded, or names no valid scope.
            PermissionDenied: The caller lacks the admin role.
        """
        _well_formed(request)
        ref = request.scope
        key = getattr(request, key_field)
        record = current_call.get()
        if record is not None:
            named = _SCOPE_NAMES.get(ref.scope, "?")
            target = ref.run_id[:128] or ref.principal[:128]
            record.detail = (f"state {action} {named}" + (f":{target}" if target else "")
                             + (f" key {key[:200]}" if key else ""))
            record.arguments = {"scope": named, "run_id": ref.run_id[:128],
                                "principal": ref.principal[:128], "key": key[:200]}
            if named == "run" and ref.run_id:
                record.run_id = ref.run_id[:128]
        if not current_principal.get().has_role(self._settings.admin_role):
            raise PermissionDenied(
                f"run state is read and changed by holders of the {self._settings.admin_role}"
                " role only", reason=reason_name(errors_pb2.PERMISSION_DENIED))
        scope, name = scope_name(ref)
        return RunState(self._store, scope, name, self._settings, writable=True)

    async def GetState(self, request: state_pb2.GetStateRequest,
                       context: grpc.aio.ServicerContext) -> state_pb2.GetStateResponse:
        async def get() -> state_pb2.GetStateResponse:
            state = self._open(request, "get")
            missing = object()
            value = await state.get(_key(request.key), missing)
            if value is missing:
                return state_pb2.GetStateResponse(found=False)
            return state_pb2.GetStateResponse(found=True, value_json=_canonical(value))

        return await _answered(get(), context)

    async def SetState(self, request: state_pb2.SetStateRequest,
                       context: grpc.aio.ServicerContext) -> state_pb2.SetStateResponse:
        async def put() -> state_pb2.SetStateResponse:
            state = self._open(request, "set")
            key = _key(request.key)
            try:
                value = json.loads(request.value_json, parse_constant=_no_constant)
            except (ValueError, RecursionError) as exc:
                raise _bad("value_json", f"value_json is not JSON: {exc}",
                           reason_name(errors_pb2.STATE_VALUE_NOT_JSON)) from None
            ttl = request.ttl_seconds or None
            try:
                await state.set(key, value, ttl=ttl)
            except StateError as exc:
                field = {"STATE_BAD_SCOPE": "ttl_seconds"}.get(exc.code, "value_json")
                if isinstance(exc, (StateQuotaExceeded, StateUnavailable)):
                    raise
                raise _bad(field, exc) from None
            return state_pb2.SetStateResponse()

        return await _answered(put(), context)

    async def DeleteState(self, request: state_pb2.DeleteStateRequest,
                          context: grpc.aio.ServicerContext
                          ) -> state_pb2.DeleteStateResponse:
        async def delete() -> state_pb2.DeleteStateResponse:
            state = self._open(request, "delete")
            return state_pb2.DeleteStateResponse(deleted=await state.delete(_key(request.key)))

        return await _answered(delete(), context)

    async def ListState(self, request: state_pb2.ListStateRequest,
                        context: grpc.aio.ServicerContext) -> state_pb2.ListStateResponse:
        async def listing() -> state_pb2.ListStateResponse:
            state = self._open(request, "list", "prefix")
            if not 0 <= request.page_size <= MAX_PAGE:
                raise _bad("page_size", f"at most {MAX_PAGE}; 0 means {DEFAULT_PAGE}",
                           reason_name(errors_pb2.INVALID_ARGUMENT))
            prefix = _key(request.prefix, "prefix", prefix=True)
            after = _key(request.after_key, "after_key", prefix=True)
            keys = [key for key in await state.keys(prefix) if key > after]
            page = keys[:request.page_size or DEFAULT_PAGE]
            reply = state_pb2.ListStateResponse(
                next_after_key=page[-1] if len(keys) > len(page) else "")
            missing = object()
            for key in page:
                entry = reply.entries.add(key=key)
                if request.with_values:
                    value = await state.get(key, missing)
                    if value is not missing:
                        entry.value_json = _canonical(value)
            return reply

        return await _answered(listing(), context)


def _key(key: str, field: str = "key", *, prefix: bool = False) -> str:
    try:
        return check_key(key, prefix=prefix)
    except StateError as exc:
        raise _bad(field, exc) from None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def _answered(call: Any, context: grpc.aio.ServicerContext) -> Any:
    """Awaits ``call``; a refusal ends the RPC with its status (state errors mapped)."""
    try:
        return await call
    except StateQuotaExceeded as exc:
        # RESOURCE_EXHAUSTED without RetryInfo: a full scope frees no space by waiting, so
        # clients must not retry it (they do when told when to come back).
        error: RequestError = RequestError(exc.message, reason=exc.code)
        error.code = grpc.StatusCode.RESOURCE_EXHAUSTED
    except StateUnavailable as exc:
        error = Unavailable(exc.message, retry_after=1.0, reason=exc.code)
    except StateError as exc:
        error = _bad("request", exc)
    except RequestError as exc:
        error = exc
    record = current_call.get()
    if record is not None:  # the record says what was asked, then why it was refused
        record.detail = f"{record.detail}, refused {error.reason}: {error.message}"
    await error.abort(context)
    raise AssertionError("abort returns never")  # pragma: no cover


def add_to_server(service: RunStateService, server: grpc.aio.Server) -> None:
    """Registers ``service`` on ``server``, with request decoding that tolerates bad bytes
    (INVALID_ARGUMENT instead of the transport's INTERNAL); a method of the contract the
    service lacks stops start-up here."""
    handlers = {}
    for method in state_pb2.DESCRIPTOR.services_by_name["RunStateService"].methods:
        request_type = getattr(state_pb2, method.input_type.name)
        response_type = getattr(state_pb2, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(service, method.name), _tolerant(request_type),
            response_type.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
