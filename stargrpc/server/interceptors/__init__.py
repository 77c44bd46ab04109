"""Server interceptors, composed in one chain.

Audit, auth and critic are each the one interceptor of :mod:`stargrpc.server.interceptors.composed`
with only its own stage; the server serves neighbouring ones as one interceptor
(:func:`~stargrpc.server.interceptors.composed.compose`), and an embedder's interceptor may sit
between any two of them. Order, outermost first, and why:

0. **tracing** (``tracing = true`` only; :mod:`stargrpc.server.interceptors.tracing`) — the
   call's span, parented by the caller's trace context, so that it covers everything below.
1. **audit** — opens the call's :class:`~stargrpc.runs.call_record.CallRecord` and writes it
   when the call ends, so it sees *every* attempt, including those authentication refuses.
2. **auth** — establishes the principal from credentials (never from the request body) or
   ends the call UNAUTHENTICATED.
3. **critic** — hands each Execute's supervision policy (the caller's deadline) to the
   service; the run itself is supervised by the runtime's run pipeline
   (:mod:`stargrpc.critic.supervision`), whatever started it.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.server.interceptors.auth import AuthInterceptor
from stargrpc.server.interceptors.critic import CriticInterceptor
from stargrpc.server.interceptors.tracing import TracingInterceptor
from stargrpc.settings import Settings


def build_chain(settings: Settings) -> Sequence[grpc.aio.ServerInterceptor]:
    """The interceptors of a server with ``settings``, outermost first."""
    chain: list[grpc.aio.ServerInterceptor] = []
    if settings.tracing:
        chain.append(TracingInterceptor(settings))  # outermost: its span covers the call
    chain.append(AuditInterceptor(settings))  # outermost: sees every attempt
    chain.append(AuthInterceptor(settings))  # the principal, before anything runs
    chain.append(CriticInterceptor(settings))  # innermost: closest to the run
    return chain
