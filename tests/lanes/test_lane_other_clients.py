"""Lanes from the Node.js and Go command lines (clients/node/cli.js, stargrpc-go) against a
real server with keys, lane ``slow`` of one slot: a call that queues prints its QUEUED
notice as a JSON line, then its START and Result; ``--max-wait`` below the estimated wait
is refused LANE_BUSY at once (one call, not retried, the estimate shown); a priority over
the caller's cap is capped, one over the contract's bound and a lane named without the
role are refused, each with its precise status."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from stargrpc.v1 import events_pb2
from tests.client_builds import RUN_TIMEOUT, json_events, run_go, run_node
from tests.helpers import key_channel, records_of
from tests.lanes.lane_helpers import (
    Holds,
    first_notice,
    hold_request,
    lane_registry,
    lane_settings,
    nap_request,
    started,
    stub_for,
)
from tests.runs_support import collect

EXECUTE = "/stargrpc.v1.ToolService/Execute"


async def _lanes_from(cli: Sequence[str], flag: str, make_auth_server: Any,
                      holds: Holds) -> None:
    """Runs the scenario of the module docstring with the command line ``cli`` (its option
    prefix ``flag``: - for Go, -- for Node.js)."""
    auth = await make_auth_server(lane_registry(), **lane_settings(),
                                  tool_lanes={"nap": "slow"}, priority_max_per_principal=2)
    alice = auth.add_key("alice")
    options = [f"{flag}target", auth.target, f"{flag}api-key", alice, f"{flag}json"]

    async def run(*args: str) -> tuple[int, str, str]:
        runner = run_go if flag == "-" else run_node
        command: Any = cli[0] if flag == "-" else list(cli)
        return await runner(command, *options, *args)

    async with key_channel(auth.target, alice) as channel:
        stub = stub_for(channel)
        # The lane's history: runs of about 0.3 s, so a wait has an estimate.
        for _ in range(2):
            await collect(stub.Execute(nap_request(0.3)))
        first = stub.Execute(hold_request("a"))
        await started(holds, 1)

        # A call that finds the slot taken queues (priority 9 capped to alice's 2).
        proc = await asyncio.create_subprocess_exec(
            *cli, *options, "call", f"{flag}priority", "9", "hold", '{"name": "b"}',
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), RUN_TIMEOUT)
        [notice] = json_events(line.decode())
        assert notice.notice.code == "QUEUED", notice
        assert (notice.notice.queued.lane, notice.notice.queued.position,
                notice.notice.queued.priority) == ("slow", 1, 2)
        holds.release("a", "b")
        assert (await collect(first))[-1].result.outcome == events_pb2.OUTCOME_OK
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
        assert proc.returncode == 0, err
        events = [notice, *json_events(out.decode())]
        assert {e.run_id for e in events} == {notice.run_id}
        after_queue = [e for e in events[1:] if not e.HasField("notice")]
        assert after_queue[0].step.phase == events_pb2.STEP_PHASE_START
        assert after_queue[-1].result.outcome == events_pb2.OUTCOME_OK
        assert after_queue[-1].result.output == "released b"
        assert after_queue[-1].result.usage.queued_seconds > 0

        # Two ahead of it (one running, one queued): the wait is estimated at about a run
        # or more, longer than the 0.01 s the caller accepts.
        running = stub.Execute(hold_request("c"))
        await started(holds, 3)
        queued = stub.Execute(hold_request("d"))
        await first_notice(queued)
        code, out, err = await run("call", f"{flag}max-wait", "0.01", "nap", '{"seconds": 0}')
        assert code == 1 and not out
        assert "RESOURCE_EXHAUSTED" in err and "[LANE_BUSY]" in err, err
        estimate = float(err.split("retry after ")[1].split("s")[0])
        assert estimate > 0.01

        # Over the contract's bound: refused; a lane named without lane_override_role too.
        code, out, err = await run("call", f"{flag}priority", "1001", "hold", '{"name": "x"}')
        assert code == 1 and not out
        assert "INVALID_ARGUMENT" in err and "priority: must be 0 to 1000" in err, err
        code, out, err = await run("call", f"{flag}lane", "slow", "hold", '{"name": "x"}')
        assert code == 1 and not out
        assert "PERMISSION_DENIED" in err and "[LANE_OVERRIDE_NOT_ALLOWED]" in err, err
        code, out, err = await run("call", f"{flag}lane", "nowhere\x1b[2J", "hold",
                                   '{"name": "x"}')
        assert code == 1 and "[LANE_UNKNOWN]" in err, err
        # Malformed on the command line: a usage error, nothing sent.
        code, _, err = await run("call", f"{flag}priority", "high", "hold", '{"name": "x"}')
        assert code == 2, err

        holds.release("c", "d")
        for call in (running, queued):
            assert (await collect(call))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert "x" not in holds.started
    records = await records_of(auth.server)
    busy = [r for r in records if r.method == EXECUTE and r.tool == "nap"
            and "longer than max_wait_seconds" in r.detail]
    assert len(busy) == 1, [(r.outcome, r.detail) for r in records if r.tool == "nap"]


async def test_node_cli_queues_and_is_refused_with_lane_statuses(
        make_auth_server: Any, holds: Holds, node_cli: list[str]) -> None:
    await _lanes_from(node_cli, "--", make_auth_server, holds)


async def test_go_cli_queues_and_is_refused_with_lane_statuses(
        make_auth_server: Any, holds: Holds, go_cli: str) -> None:
    await _lanes_from([go_cli], "-", make_auth_server, holds)
