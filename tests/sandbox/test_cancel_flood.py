"""A flood of sandboxed calls, each dropped by its client at a random moment (before its run
is admitted, while its sandbox starts, while the command runs): through a real server,
nothing is left running — no run in flight, no process — and the server still serves."""

from __future__ import annotations

import asyncio
import json
import random

import grpc

from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.runs_support import collect, execute_request
from tests.sandbox.proctable import marker, wait_until_gone

ROUNDS = 3
CALLS_PER_ROUND = 20
BOUND = 30.0


async def test_calls_dropped_at_random_moments_leave_nothing_running(make_server) -> None:
    server = await make_server()
    token = marker()
    # The command carries the marker on its command line, where the process table shows it.
    code = ("import os, sys; os.execv(sys.executable, "
            f"[sys.executable, '-c', 'import time; time.sleep(60)', '{token}'])")
    request = tool_service_pb2.ExecuteRequest(tool_name="python",
                                              arguments_json=json.dumps({"code": code}))
    chooser = random.Random(15)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)

        async def dropped(delay: float) -> None:
            call = stub.Execute(request)
            await asyncio.sleep(delay)
            call.cancel()

        for _ in range(ROUNDS):
            await asyncio.gather(*(dropped(chooser.uniform(0.0, 0.3))
                                   for _ in range(CALLS_PER_ROUND)))

        async with asyncio.timeout(BOUND):  # each run ends once its stop reaches it
            await asyncio.gather(*(run.wait() for run in list(server.runtime.runs.values())))
        left = await wait_until_gone(token, within=BOUND)
        served = await collect(stub.Execute(execute_request("echo", {"text": "still"})))

    assert left == [] and not server.runtime.runs
    assert served[-1].result.output == "still"
