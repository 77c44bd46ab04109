"""An example remote critic: a CriticService that stargrpc reaches at ``--critic-url``.

It judges each run on its own stream:

- a run whose output repeats the same line ``repeats`` times in a row is in a loop: it is
  stopped with code ``LOOP_DETECTED``;
- a run that has produced no output for half its soft timeout is steered ("report what
  you are doing, or finish");
- asked at the soft deadline, it gives a run that produced output since the last ask
  another soft timeout, and lets a silent one be stopped.

Run it, then point a server at it::

    python examples/remote_critic.py --port 50061 --repeats 5 &
    stargrpc serve --critic-url 127.0.0.1:50061
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from stargrpc.v1 import critic_pb2, critic_pb2_grpc

STEER_MESSAGE = "you have produced nothing for half your time: report what you are doing, or finish"


class LoopCritic(critic_pb2_grpc.CriticServiceServicer):
    """Stops looping runs, steers silent ones (see the module docstring)."""

    def __init__(self, repeats: int = 5) -> None:
        self.repeats = repeats

    async def Supervise(self, request_iterator: AsyncIterator[critic_pb2.SuperviseRequest],
                        context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[critic_pb2.SuperviseResponse]:
        verdicts: asyncio.Queue[critic_pb2.SuperviseResponse | None] = asyncio.Queue()
        reader = asyncio.create_task(self._judge(request_iterator, verdicts))
        try:
            while (verdict := await verdicts.get()) is not None:
                yield verdict
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _judge(self, requests: AsyncIterator[critic_pb2.SuperviseRequest],
                     verdicts: asyncio.Queue[critic_pb2.SuperviseResponse | None]) -> None:
        loop = asyncio.get_running_loop()
        steer: asyncio.TimerHandle | None = None
        soft = 0.0
        last_line, same, partial = "", 0, ""
        output_since_ask = False

        def silent() -> None:
            verdicts.put_nowait(critic_pb2.SuperviseResponse(
                steer=critic_pb2.Steer(message=STEER_MESSAGE)))

        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "start":
                    soft = request.start.soft_timeout.ToNanoseconds() / 1e9
                    steer = loop.call_later(soft / 2, silent)
                elif kind == "ask":
                    if output_since_ask:
                        extend = critic_pb2.Extend(reason="output keeps coming")
                        extend.within.FromNanoseconds(int(soft * 1e9))
                        verdicts.put_nowait(critic_pb2.SuperviseResponse(extend=extend))
                    else:
                        verdicts.put_nowait(critic_pb2.SuperviseResponse(keep=critic_pb2.Keep()))
                    output_since_ask = False
                elif kind == "event" and request.event.step.delta:
                    output_since_ask = True
                    if steer is not None:  # it spoke: restart the silence timer
                        steer.cancel()
                        steer = loop.call_later(soft / 2, silent)
                    *lines, partial = (partial + request.event.step.delta).split("\n")
                    for line in lines:
                        same = same + 1 if line == last_line else 1
                        last_line = line
                        if same >= self.repeats:
                            verdicts.put_nowait(critic_pb2.SuperviseResponse(stop=critic_pb2.Stop(
                                code="LOOP_DETECTED",
                                reason=f"the same line came {same} times in a row: {line[:80]!r}")))
                            same = 0
        finally:
            if steer is not None:
                steer.cancel()
            verdicts.put_nowait(None)


async def serve(port: int = 0, repeats: int = 5, host: str = "127.0.0.1"
                ) -> tuple[grpc.aio.Server, int]:
    """Starts the critic on ``host:port`` (0: a free port); returns the server and port."""
    server = grpc.aio.server()
    critic_pb2_grpc.add_CriticServiceServicer_to_server(LoopCritic(repeats), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50061)
    parser.add_argument("--repeats", type=int, default=5, help="Repeated lines that make a loop.")
    options = parser.parse_args()
    server, port = await serve(options.port, options.repeats, options.host)
    print(f"remote critic listening on {options.host}:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
