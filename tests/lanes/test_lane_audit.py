"""The audit trail of lanes: a queued call's record carries its lane, priority and wait (and
a priority it was refused), a refusal its reason."""

from __future__ import annotations

import grpc
import pytest

from stargrpc.audit.record import AuditRecord
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors.audit import AuditInterceptor
from tests.helpers import eventually, key_channel
from tests.lanes.lane_helpers import (
    Holds,
    first_notice,
    hold_request,
    lane_registry,
    lane_settings,
    started,
    stub_for,
)
from tests.runs_support import collect


async def _records(server: StargrpcServer) -> list[AuditRecord]:
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await eventually(lambda: audit.open_calls == 0, what="every open call's record written")
    await audit.writer.flush()
    return [r async for r in audit.writer.store.scan()]


async def test_the_audit_record_carries_the_wait_and_the_refusals(make_auth_server: object,
                                                                  holds: Holds) -> None:
    auth = await make_auth_server(  # type: ignore[operator]
        lane_registry(), roles=("user",), priority_max_per_principal=2,
        **lane_settings(slow={"max_concurrent": 1, "max_queued": 1}))
    async with key_channel(auth.target, auth.key) as channel:
        stub = stub_for(channel)
        first = stub.Execute(hold_request("a"))
        await started(holds, 1)
        queued = stub.Execute(hold_request("b", priority=9))
        await first_notice(queued)
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(stub.Execute(hold_request("c")))
        holds.release("a", "b")
        await collect(first)
        await collect(queued)
    records = {r.arguments: r for r in await _records(auth.server)
               if r.method.endswith("/Execute")}
    waited = records['{"name":"b"}']
    assert waited.outcome == "ok"
    assert "lane slow, priority 2, waited" in waited.detail
    assert "priority asked 9, capped to 2" in waited.detail
    assert "lane slow, priority 0, waited 0.000 s" in records['{"name":"a"}'].detail
    refused = records['{"name":"c"}']
    assert refused.outcome == "failed"
    assert "the queue of lane 'slow' is full (max_queued 1)" in refused.detail
