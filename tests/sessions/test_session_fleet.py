"""Sessions in a fleet: two replicas on the real Redis; a call reaching the replica that
does not hold its session is forwarded to the one that does, vouched for with the fleet's
secret; the holder gone, SESSION_LOST."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from stargrpc.auth.keys import KeyStore
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, key_channel, run_tool
from tests.procs import ServerProcess, server_env
from tests.sessions.conftest import REDIS_URL
from tests.sessions.session_helpers import create, python, reason

FLEET_SECRET = "f" * 16 + "the fleet's test secret"


@pytest.fixture
async def fleet(make_server, redis_prefix, tmp_path):
    keys_file = tmp_path / "keys.json"
    store = KeyStore(keys_file)
    keys = {name: store.create(name, ("admin",))[1] for name in ("alice", "bob")}

    async def replica():
        return await make_server(insecure_no_auth=False, keys_file=keys_file,
                                 redis_url=REDIS_URL, redis_key_prefix=redis_prefix,
                                 session_advertise_address="127.0.0.1:0",
                                 fleet_secret=FLEET_SECRET, sandbox_max_processes=32)

    return await replica(), await replica(), keys


def stub_of(channel) -> tool_service_pb2_grpc.ToolServiceStub:
    return tool_service_pb2_grpc.ToolServiceStub(channel)


async def test_a_call_reaching_another_replica_is_forwarded_to_the_owner(fleet) -> None:
    a, b, keys = fleet
    async with key_channel(f"127.0.0.1:{a.port}", keys["alice"]) as on_a, \
            key_channel(f"127.0.0.1:{b.port}", keys["alice"]) as on_b:
        session_id = await create(stub_of(on_a))
        await python(stub_of(on_a), session_id, "x = 20")
        # Through the other replica, streamed as if it were local.
        events = await run_tool(stub_of(on_b), "python", {"code": "print('hi')\nx + 22"},
                                session_id=session_id)
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
        assert as_dict(events[-1].result)["structured_output"] == 42
        assert any(e.HasField("step") and e.step.delta == "hi\n" for e in events)
        started = await stub_of(on_b).StartRun(tool_service_pb2.StartRunRequest(
            tool_name="python", arguments_json='{"code": "x"}', session_id=session_id))
        assert started.run_id
        # Closed through the other replica too.
        await stub_of(on_b).CloseSession(tool_service_pb2.CloseSessionRequest(
            session_id=session_id))
        assert list((await stub_of(on_a).ListSessions(
            tool_service_pb2.ListSessionsRequest())).sessions) == []
        for stub in (stub_of(on_a), stub_of(on_b)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await python(stub, session_id, "x")
            assert reason(caught.value) == "SESSION_NOT_FOUND"


async def test_another_principal_is_not_forwarded(fleet) -> None:
    a, b, keys = fleet
    async with key_channel(f"127.0.0.1:{a.port}", keys["alice"]) as on_a, \
            key_channel(f"127.0.0.1:{b.port}", keys["bob"]) as bob_on_b:
        session_id = await create(stub_of(on_a))
        for attempt in (lambda: python(stub_of(bob_on_b), session_id, "1"),
                        lambda: stub_of(bob_on_b).CloseSession(
                            tool_service_pb2.CloseSessionRequest(session_id=session_id))):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await attempt()
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert reason(caught.value) == "SESSION_NOT_FOUND"


async def test_the_owner_gone_makes_the_session_lost(fleet) -> None:
    a, b, keys = fleet
    async with key_channel(f"127.0.0.1:{a.port}", keys["alice"]) as on_a, \
            key_channel(f"127.0.0.1:{b.port}", keys["alice"]) as on_b:
        session_id = await create(stub_of(on_a))
        # The owner dies without a word: its record stays, its lease lapses (here: at once).
        directory = a.service.sessions.directory
        assert directory is not None
        directory._held.clear()
        await directory._redis.delete(directory._lease_key(session_id))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await python(stub_of(on_b), session_id, "1")
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason(caught.value) == "SESSION_LOST"


async def test_an_owner_killed_the_instant_after_creating_a_session_makes_it_lost(
        make_server, redis_prefix, tmp_path) -> None:
    # A real process, SIGKILLed right after it acknowledged CreateSession: its record and
    # lease are still in Redis, its address answers nothing. A call through another replica
    # is refused SESSION_LOST within a bound — it neither hangs nor runs anywhere else.

    keys_file = tmp_path / "keys.json"
    key = KeyStore(keys_file).create("alice", ("admin",))[1]
    owner = ServerProcess([], server_env(
        tmp_path / "owner", STARGRPC_INSECURE_NO_AUTH="false", STARGRPC_KEYS_FILE=str(keys_file),
        STARGRPC_REDIS_URL=REDIS_URL, STARGRPC_REDIS_KEY_PREFIX=redis_prefix,
        STARGRPC_SESSION_ADVERTISE_ADDRESS="127.0.0.1:0", STARGRPC_FLEET_SECRET=FLEET_SECRET))
    forwarder = await make_server(insecure_no_auth=False, keys_file=keys_file,
                                  redis_url=REDIS_URL, redis_key_prefix=redis_prefix,
                                  session_advertise_address="127.0.0.1:0",
                                  fleet_secret=FLEET_SECRET)
    try:
        async with key_channel(owner.target, key) as on_owner:
            session_id = await create(stub_of(on_owner))
        owner.signal(signal.SIGKILL)
        owner.proc.wait(10)
        async with key_channel(f"127.0.0.1:{forwarder.port}", key) as on_forwarder:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(python(stub_of(on_forwarder), session_id, "1"), 60)
    finally:
        owner.stop()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value
    assert reason(caught.value) == "SESSION_LOST"
