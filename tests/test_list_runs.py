"""ListRuns through gRPC, HTTP and the CLI: a caller sees its own runs only (an operator
role sees everyone's, with the principal), newest first, filtered and paged with a token;
in the embedded default and across two replicas sharing Redis."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from redis import Redis as SyncRedis

from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import AuthServerFactory, ServerFactory
from tests.helpers import eventually, stargrpc_cli
from tests.runs_support import HeaderPrincipal, as_principal, execute_request, run_registry
from tests.stores.conftest import LoopbackCluster, redis_cluster, redis_prefix, replicas

pb = tool_service_pb2
# The Redis fixtures, shared with tests/stores.
__all__ = ["redis_cluster", "redis_prefix", "replicas"]
Stub = tool_service_pb2_grpc.ToolServiceStub


def hand_made(cursor: list[Any]) -> str:
    """A page token the way a client could make one: a cursor, base64-encoded."""
    return base64.urlsafe_b64encode(json.dumps(cursor).encode()).decode().rstrip("=")


async def run_to_end(stub: Stub, tool: str, arguments: dict[str, Any],
                     metadata: Sequence[tuple[str, str]]) -> events_pb2.RunEvent:
    """Runs a tool and returns its Result event."""
    last = None
    async for response in stub.Execute(execute_request(tool, arguments), metadata=metadata):
        last = response.event
    assert last is not None and last.HasField("result")
    return last


async def list_all(stub: Stub, metadata: Sequence[tuple[str, str]], **fields: Any
                   ) -> list[pb.RunSummary]:
    """Every page of ListRuns, in order (bounded)."""
    runs: list[pb.RunSummary] = []
    token = ""
    for _ in range(100):
        reply = await stub.ListRuns(pb.ListRunsRequest(page_token=token, **fields),
                                    metadata=metadata)
        runs.extend(reply.runs)
        token = reply.next_page_token
        if not token:
            return runs
    raise AssertionError("ListRuns never ended its pages")


async def start_waiting(stub: Stub, gate: Path, tally: Path,
                        metadata: Sequence[tuple[str, str]]
                        ) -> tuple[grpc.aio.UnaryStreamCall, str]:
    """Starts a ``tally`` run that waits at ``gate`` (a file); its call and run id."""
    call = stub.Execute(execute_request("tally", {"path": str(tally), "gate": str(gate),
                                                  "deltas": 1},
                                        idempotency_key=f"wait-{gate.name}"),
                        metadata=metadata)
    first = await call.read()
    return call, first.event.run_id


async def listed_at_gate(stub: Stub, metadata: Sequence[tuple[str, str]], run_id: str,
                         **fields: Any) -> pb.RunSummary | None:
    """The summary of ``run_id`` if a listing (with ``fields``) shows it in its top step
    (the ``Tallying`` step over, waiting at the gate)."""
    return next((run for run in await list_all(stub, metadata, **fields)
                 if run.run_id == run_id and run.current_step == "tally"), None)


ALICE = as_principal("alice")
BOB = as_principal("bob")
OPS = as_principal("ops", "watch")


async def check_ownership_filters_and_paging(first: Stub, second: Stub, tmp_path: Path) -> None:
    """The shared scenario: runs of alice (on both stubs' servers) and bob."""
    mine = [await run_to_end(first, "echo", {"text": f"a{i}"}, ALICE) for i in range(3)]
    mine.append(await run_to_end(second, "count", {"to": 2}, ALICE))
    theirs = await run_to_end(second, "echo", {"text": "b"}, BOB)
    gate = tmp_path / "gate"
    call, waiting = await start_waiting(first, gate, tmp_path / "tally", ALICE)
    try:
        # Alice sees her runs only, newest first, from either replica, and no principal.
        running = await eventually(  # polling another replica's flush; bounded
            lambda: listed_at_gate(second, ALICE, waiting, state=pb.RUN_STATE_RUNNING),
            within=10, interval=0.025, what=f"run {waiting} listed as running at its gate")
        assert running.tool_name == "tally" and running.last_seq > 0
        assert not running.HasField("ended_at")
        listed = await list_all(second, ALICE)
        assert [r.run_id for r in listed] == [waiting, *[e.run_id for e in reversed(mine)]]
        assert theirs.run_id not in {r.run_id for r in await list_all(first, ALICE)}
        assert {r.principal for r in listed} == {""}
        finished = listed[1]
        assert (finished.tool_name, finished.state, finished.outcome) == (
            "count", pb.RUN_STATE_FINISHED, events_pb2.OUTCOME_OK)
        assert finished.last_seq == mine[-1].seq and finished.current_step == ""
        assert finished.ended_at.ToMilliseconds() >= finished.started_at.ToMilliseconds() > 0

        # Bob sees only his; the operator role sees everyone's, with who started each.
        assert [r.run_id for r in await list_all(first, BOB)] == [theirs.run_id]
        everyone = await list_all(first, OPS)
        assert {r.run_id for r in everyone} >= {theirs.run_id, waiting,
                                                 *[e.run_id for e in mine]}
        assert {r.principal for r in everyone if r.run_id == theirs.run_id} == {"bob"}

        # Filters: tool, state, outcome.
        assert [r.run_id for r in await list_all(second, ALICE, tool_name="echo")] == [
            e.run_id for e in reversed(mine[:3])]
        assert [r.run_id for r in await list_all(first, ALICE,
                                                 state=pb.RUN_STATE_RUNNING)] == [waiting]
        assert waiting not in {r.run_id for r in await list_all(
            first, ALICE, state=pb.RUN_STATE_FINISHED)}
        assert await list_all(first, ALICE, outcome=events_pb2.OUTCOME_CANCELLED) == []

        # Paging: pages of 2 give the same runs, in the same order, without repeats.
        paged = await list_all(second, ALICE, page_size=2)
        assert [r.run_id for r in paged] == [r.run_id for r in listed]
        reply = await second.ListRuns(pb.ListRunsRequest(page_size=2), metadata=ALICE)
        assert len(reply.runs) == 2 and reply.next_page_token
        # A token one replica made continues on the other (they share the signing key).
        rest = await first.ListRuns(pb.ListRunsRequest(page_token=reply.next_page_token),
                                    metadata=ALICE)
        assert [r.run_id for r in [*reply.runs, *rest.runs]] == [r.run_id for r in listed]

        # A cancelled run then shows with its outcome.
        assert (await first.CancelRun(pb.CancelRunRequest(run_id=waiting),
                                      metadata=ALICE)).cancelled
        while await call.read() is not grpc.aio.EOF:
            pass

        async def cancelled_runs() -> list[str]:
            return [r.run_id for r in await list_all(
                second, ALICE, outcome=events_pb2.OUTCOME_CANCELLED)]

        # Another replica's Result reaches Redis a moment later.
        cancelled = await eventually(cancelled_runs, within=5, interval=0.025,
                                     what="a cancelled run listed")
        assert cancelled == [waiting]
    finally:
        gate.touch()
        call.cancel()


async def test_list_runs_in_the_embedded_default(make_server: ServerFactory,
                                                 tmp_path: Path) -> None:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = Stub(channel)
        await check_ownership_filters_and_paging(stub, stub, tmp_path)


async def test_list_runs_across_two_replicas_on_redis(replicas, tmp_path: Path) -> None:
    first_server, second_server = await replicas(), await replicas()
    async with (grpc.aio.insecure_channel(f"127.0.0.1:{first_server.port}") as one,
                grpc.aio.insecure_channel(f"127.0.0.1:{second_server.port}") as two):
        await check_ownership_filters_and_paging(Stub(one), Stub(two), tmp_path)


async def test_list_runs_across_two_replicas_on_a_redis_cluster(
        make_server: ServerFactory, redis_cluster: LoopbackCluster, tmp_path: Path) -> None:
    """The same on a Redis Cluster (3 primaries, 3 replicas), where the indexes and the
    runs live in slots of their own on different nodes; then, once the slots of the indexes
    and of every listed run have moved to other primaries, the listings are unchanged."""
    servers = [await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                                 redis_url=redis_cluster.url, redis_key_prefix="stargrpc:")
               for _ in range(2)]
    async with (grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as one,
                grpc.aio.insecure_channel(f"127.0.0.1:{servers[1].port}") as two):
        first, second = Stub(one), Stub(two)
        await check_ownership_filters_and_paging(first, second, tmp_path)
        before = {who: await list_all(first, who) for who in (ALICE, BOB, OPS)}
        paged = await list_all(second, OPS, page_size=3)
        listed = {run.run_id for run in before[OPS]}
        keys = [f"stargrpc:runs:{name}" for name in ("all", "owner:*")]
        await asyncio.to_thread(_move_slots_of, redis_cluster, keys, listed)
        after = {who: await list_all(second, who) for who in (ALICE, BOB, OPS)}
        assert [r.run_id for r in await list_all(first, OPS, page_size=3)] == [
            r.run_id for r in paged]
    for who in (ALICE, BOB, OPS):
        assert [r.SerializeToString() for r in after[who]] == [
            r.SerializeToString() for r in before[who]]
    assert [r.run_id for r in paged] == [r.run_id for r in before[OPS]]


def _move_slots_of(cluster: LoopbackCluster, patterns: list[str], run_ids: set[str]) -> None:
    """Moves the slots of the keys matching ``patterns`` and of the runs ``run_ids`` to
    the next primary (each primary's share to the one after it)."""
    from redis.crc import key_slot

    wanted = {key_slot(run_id.encode()) for run_id in run_ids}  # the runs' hash tags
    primaries = sorted(cluster.primary_ports())
    for port in primaries:
        node = SyncRedis(host="127.0.0.1", port=port)
        try:
            for pattern in patterns:
                wanted.update(key_slot(k) for k in node.scan_iter(match=pattern, count=1000))
        finally:
            node.close()
    shares = [sorted(wanted & set(cluster.slots_of(port))) for port in primaries]
    for i, (port, share) in enumerate(zip(primaries, shares, strict=True)):
        if share:
            cluster.move_slots(port, primaries[(i + 1) % 3], share)


async def test_bad_page_tokens_and_sizes_are_refused_and_the_server_goes_on(
        make_server: ServerFactory) -> None:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = Stub(channel)
        forged = [
            "not-a-token", "W10", "WzEsMl0",  # [] and [1,2]
            "eyJhIjoxfQ",  # {"a":1}
            "WyIxIiwgIngiXQ",  # ["1", "x"]: the start is not a number
            "%%%%", "A" * 5000,
            # Well-formed cursors, but made by hand: a token must be one the server signed.
            hand_made([int(time.time() * 1000), "run"]), hand_made([True, "run"]),
            hand_made([2**70, "run"]),
            # Sealed-looking, but sealed by nobody.
            "s1.", "s1." + "A" * 64, "s1.%%%%",
        ]
        for token in forged:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListRuns(pb.ListRunsRequest(page_token=token), metadata=ALICE)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            status = rpc_status.from_call(refused.value)
            assert status is not None
            bad = error_details_pb2.BadRequest()
            assert any(d.Unpack(bad) for d in status.details)
            assert [v.field for v in bad.field_violations] == ["page_token"]
        with pytest.raises(grpc.aio.AioRpcError) as too_big:
            await stub.ListRuns(pb.ListRunsRequest(page_size=201), metadata=ALICE)
        assert too_big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A token from someone else's listing shows nothing of theirs: the owner filter
        # comes from the caller, never from the token.
        await run_to_end(stub, "echo", {"text": "b"}, BOB)
        await run_to_end(stub, "echo", {"text": "b2"}, BOB)
        page = await stub.ListRuns(pb.ListRunsRequest(page_size=1), metadata=BOB)
        assert page.next_page_token
        stolen = await stub.ListRuns(pb.ListRunsRequest(page_token=page.next_page_token),
                                     metadata=ALICE)
        assert list(stolen.runs) == []
        # A real token altered (one byte of its sealed cursor flipped) or cut short is
        # refused too; and it shows nothing of the run it points at.
        token = page.next_page_token
        sealed = bytearray(base64.urlsafe_b64decode(token[3:] + "=="))
        assert page.runs[-1].run_id not in sealed.decode("latin-1")
        sealed[-20] ^= 1
        flipped = token[:3] + base64.urlsafe_b64encode(bytes(sealed)).decode().rstrip("=")
        for altered in (flipped, token[:-4]):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListRuns(pb.ListRunsRequest(page_token=altered), metadata=BOB)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await run_to_end(stub, "echo", {"text": "still serving"}, ALICE)


# -- HTTP and the CLI, with real API keys ----------------------------------------------------


async def test_list_runs_over_http_and_the_cli(make_auth_server: AuthServerFactory) -> None:
    auth = await make_auth_server(roles=("user",), http_port=0)
    server: StargrpcServer = auth.server
    bob = auth.add_key("bob", "user")
    ops = auth.add_key("ops", "watch")
    base = f"http://127.0.0.1:{server.http.gateway_port}"

    def bearer(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        started = []
        for text in ("one", "two", "three"):
            reply = await http.post("/v1/tools/echo:execute?wait=true", headers=bearer(auth.key),
                                    json={"arguments": {"text": text}})
            assert reply.status_code == 200, reply.text
            started.append(reply.json()["run_id"])
        reply = await http.post("/v1/tools/count:execute?wait=true", headers=bearer(bob),
                                json={"arguments": {"to": 1}})
        theirs = reply.json()["run_id"]

        listed = (await http.get("/v1/runs", headers=bearer(auth.key))).json()
        assert [r["run_id"] for r in listed["runs"]] == started[::-1]
        assert listed["runs"][0]["state"] == "RUN_STATE_FINISHED"
        assert listed["runs"][0]["outcome"] == "OUTCOME_OK"
        assert listed["next_page_token"] == ""

        first = (await http.get("/v1/runs", params={"page_size": 2},
                                headers=bearer(auth.key))).json()
        rest = (await http.get("/v1/runs", params={"page_token": first["next_page_token"]},
                               headers=bearer(auth.key))).json()
        assert [r["run_id"] for r in first["runs"] + rest["runs"]] == started[::-1]

        everyone = (await http.get("/v1/runs", params={"tool": "count", "state": "finished",
                                                       "outcome": "ok"},
                                   headers=bearer(ops))).json()
        assert [(r["run_id"], r["principal"]) for r in everyone["runs"]] == [(theirs, "bob")]

        bad = await http.get("/v1/runs", params={"state": "sleeping", "page_size": "-1"},
                             headers=bearer(auth.key))
        assert bad.status_code == 400
        fields = {v["field"] for v in bad.json()["error"]["details"][0]["fieldViolations"]}
        assert fields == {"state", "page_size"}
        for token in ("x", hand_made([int(time.time() * 1000), "run"])):
            for url in ("/v1/runs", "/v1/runs/events"):
                refused = await http.get(url, params={"page_token": token},
                                         headers=bearer(auth.key))
                assert refused.status_code == 400, (url, token, refused.text)
                violations = refused.json()["error"]["details"][0]["fieldViolations"]
                assert [v["field"] for v in violations] == ["page_token"]
        assert (await http.get("/v1/runs")).status_code == 401

        # The live list: the first page at once, then again when a run is added.
        async with http.stream("GET", "/v1/runs/events", headers=bearer(auth.key)) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            snapshots: list[dict[str, Any]] = []
            added = ""
            async with asyncio.timeout(30):
                async for line in lines:
                    if not line.startswith("data:"):
                        continue
                    snapshots.append(json.loads(line.removeprefix("data:")))
                    if len(snapshots) == 1:
                        reply = await http.post("/v1/tools/echo:execute?wait=true",
                                                headers=bearer(auth.key),
                                                json={"arguments": {"text": "four"}})
                        added = reply.json()["run_id"]
                    elif snapshots[-1]["runs"][0]["run_id"] == added:
                        break
            assert [r["run_id"] for r in snapshots[0]["runs"]] == started[::-1]
            assert theirs not in {r["run_id"] for s in snapshots for r in s["runs"]}

    target = f"127.0.0.1:{server.port}"
    code, out, err = await stargrpc_cli("runs", "--target", target, "--api-key", auth.key,
                                     "--limit", "2")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()] == [added, started[2]]
    assert "--page-token" in err
    code, out, _ = await stargrpc_cli("runs", "--target", target, "--api-key", ops, "--json",
                                   "--tool", "count")
    assert code == 0
    assert [r["principal"] for r in json.loads(out)["runs"]] == ["bob"]
    code, _, err = await stargrpc_cli("runs", "--target", target, "--api-key", bob,
                                   "--page-token", "garbage")
    assert code == 1 and "page_token" in err
