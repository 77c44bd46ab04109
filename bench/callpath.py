"""``python -m bench.callpath``: the framework's own CPU per trivial call, in-process.

stargrpc's part of an Execute of ``bench_trivial`` (START, END, Result) without the
transport: a real :class:`~stargrpc.server.StargrpcServer` as ``stargrpc serve`` builds it
(API-key auth, the SQLite audit, the critic, the in-memory run log; ``--redis`` for the
Redis one), its interceptor chain run the way grpc.aio runs it (each call in a task of its
own, the interceptors' continuations, then the handler's responses serialised), against a
servicer context that answers what the layers ask of gRPC's. What is left out is grpc.aio
itself and the socket: this is the part of a call a change to stargrpc can make cheaper,
measured without the noise of the transport (``bench/ab.py`` measures the whole call).

    python -m bench.callpath                 # CPU µs per call, best of 5 rounds
    python -m bench.callpath --profile       # and a cProfile of the rounds, by own time
    python -m bench.callpath --separate      # also the chain unfused, rounds in turns
    python -m bench.callpath --layers-only   # the interceptors alone: Execute runs no tool
    python -m bench.callpath --concurrent 200  # calls of bench_wait (10 ms), 200 at once

``--concurrent N`` measures the concurrent path of ``python -m bench``'s concurrency figure
in-process: ``bench_wait`` calls (``{"ms": 10}``) started N at a time, each in its task,
the next N once they have all ended; the CPU per call is what the loop spent on them, timers
and waiting included (``--concurrent 1``: the same calls one at a time).

Bounded: a fixed number of calls; everything in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from stargrpc.server.streaming import serialize_response
from stargrpc.settings import Settings
from stargrpc.v1 import tool_service_pb2

try:
    from stargrpc.contract import SERVICE_NAME
except ImportError:  # a tree from before the contract's names had a module of their own
    from stargrpc.server.service import SERVICE_NAME

EXECUTE = f"/{SERVICE_NAME}/Execute"
REDIS_URL = "redis://127.0.0.1:6379/0"


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


class _Context:
    """What the layers ask of grpc.aio's servicer context, answered as it would."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self._code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def auth_context(self) -> dict[str, Any]:
        return {}

    def time_remaining(self) -> float:
        return 60.0

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return ""

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> None:
        self._code = code
        raise RuntimeError(f"aborted: {code} {details}")


async def _handler(interceptors: Sequence[grpc.aio.ServerInterceptor],
                   lookup: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                   details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
    """The handler of a call through the interceptors, as grpc.aio's server finds it."""

    async def innermost(d: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return lookup(d)

    continuation: Callable[[grpc.HandlerCallDetails],
                           Awaitable[grpc.RpcMethodHandler | None]] = innermost
    for interceptor in reversed(interceptors):
        continuation = _bind(interceptor, continuation)
    return await continuation(details)


def _bind(interceptor: grpc.aio.ServerInterceptor,
          inner: Callable[[grpc.HandlerCallDetails], Awaitable[Any]]
          ) -> Callable[[grpc.HandlerCallDetails], Awaitable[Any]]:
    async def continuation(details: grpc.HandlerCallDetails) -> Any:
        return await interceptor.intercept_service(inner, details)

    return continuation


async def _measure(args: argparse.Namespace, folder: Path) -> None:
    from stargrpc.auth.keys import KeyStore
    from stargrpc.logs import configure_logging
    from stargrpc.server.grpc_server import StargrpcServer

    overrides: dict[str, Any] = {
        "host": "127.0.0.1", "port": 0, "state_dir": folder / "state", "log_format": "json",
        "tools_dir": [Path(__file__).parent / "tools"], "insecure_no_auth": False,
        "max_concurrent_runs": 0, "max_concurrent_runs_per_principal": 0,
    }
    if args.redis:
        overrides["redis_url"] = REDIS_URL
    settings = Settings.load(**overrides)
    log_file = (folder / "server.log").open("w")
    configure_logging(settings.log_level, "json", stream=log_file, cache=True)
    _, token = KeyStore(settings.state_dir / "keys.json").create("bench", ["admin"])
    from stargrpc.server.interceptors import build_chain

    chain = [i for i in build_chain(settings)
             if type(i).__module__.rsplit(".", 1)[-1] not in args.without]
    server = StargrpcServer(settings, interceptors=chain)
    # The parts the server serves calls with: its chain as served, and its handlers.
    for component in server.interceptors:
        start = getattr(component, "start", None)
        if start is not None:
            await start()
    try:
        from stargrpc.server.interceptors.composed import compose
    except ImportError:  # a tree from before the chain was composed
        interceptors = list(server.interceptors)
    else:
        interceptors = compose(server.interceptors)
    # As served; with --separate also each interceptor wrapping the call on its own.
    chains = {"fused": interceptors}
    if args.separate:
        chains["separate"] = list(server.interceptors)
    execute = _layers_only_handler() if args.layers_only else _execute_handler(server)
    metadata = (("authorization", f"Bearer {token}"),)
    request = (tool_service_pb2.ExecuteRequest(tool_name="bench_wait", arguments_json='{"ms": 10}')
               if args.concurrent else
               tool_service_pb2.ExecuteRequest(tool_name="bench_trivial", arguments_json="{}"))
    data = request.SerializeToString()
    details = _Details(EXECUTE, metadata)

    def lookup(d: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return execute if d.method == EXECUTE else None

    async def one_call(interceptors: Sequence[grpc.aio.ServerInterceptor]) -> int:
        context = _Context(metadata)
        handler = await _handler(interceptors, lookup, details)
        assert handler is not None and handler.unary_stream is not None
        message = handler.request_deserializer(data)
        sent = 0
        async for response in handler.unary_stream(message, context):
            handler.response_serializer(response)
            sent += 1
        return sent

    loop = asyncio.get_running_loop()

    async def rounds(calls: int, interceptors: Sequence[grpc.aio.ServerInterceptor]) -> float:
        started = time.process_time()
        if args.concurrent:
            for _ in range(max(1, calls // args.concurrent)):
                sent_all = await asyncio.gather(*(loop.create_task(one_call(interceptors))
                                                  for _ in range(args.concurrent)))
                assert set(sent_all) == {3}, sent_all
            calls = max(1, calls // args.concurrent) * args.concurrent
            return (time.process_time() - started) / calls * 1e6
        for _ in range(calls):
            # Each call in a task of its own, as grpc.aio serves it.
            sent = await loop.create_task(one_call(interceptors))
            assert sent == 3, sent
        return (time.process_time() - started) / calls * 1e6

    for chain in chains.values():
        await rounds(200, chain)  # warm-up
    import gc
    gc.collect()
    gc.freeze()
    gc.set_threshold(5_000, 20, 20)
    profile = cProfile.Profile() if args.profile else None
    figures: dict[str, list[float]] = {name: [] for name in chains}
    for _ in range(args.rounds):
        for name, chain in chains.items():  # in turns, so the machine's noise falls on all
            if profile is not None:
                profile.enable()
            figures[name].append(await rounds(args.calls, chain))
            if profile is not None:
                profile.disable()
    for name, measured in figures.items():
        kind = (f"bench_wait call, {args.concurrent} at once" if args.concurrent
                else "trivial call")
        print(f"stargrpc's own CPU per {kind} ({'Redis' if args.redis else 'in-memory'} "
              f"run log{', ' + name if len(figures) > 1 else ''}): best {min(measured):.1f} "
              f"µs, median {sorted(measured)[len(measured) // 2]:.1f} µs over {args.rounds} "
              f"rounds of {args.calls} calls")
    if args.separate:  # round by round: what the noise of the moment adds falls on both
        paired = sorted(s - f for f, s in zip(figures["fused"], figures["separate"],
                                                strict=True))
        print(f"separate less fused, round by round: median {paired[len(paired) // 2]:+.1f} "
              f"µs (from {paired[0]:+.1f} to {paired[-1]:+.1f})")
    if profile is not None:
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(args.top)
    await server.runtime.store.aclose()
    for component in reversed(server.interceptors):
        close = getattr(component, "aclose", None)
        if close is not None:
            await close()
    log_file.close()


def _execute_handler(server: Any) -> grpc.RpcMethodHandler:
    from stargrpc.server.service import _tolerant

    return grpc.unary_stream_rpc_method_handler(
        server.service.Execute, _tolerant(tool_service_pb2.ExecuteRequest), serialize_response)


def _layers_only_handler() -> grpc.RpcMethodHandler:
    """An Execute that runs nothing: it yields three prebuilt responses, so what is measured
    is the interceptors' part of the call (the audit record is still written)."""
    from stargrpc.server.service import _tolerant
    from stargrpc.v1 import events_pb2

    responses = [tool_service_pb2.ExecuteResponse(event=events_pb2.RunEvent(seq=seq))
                 for seq in (1, 2, 3)]

    async def execute(request: Any, context: Any) -> Any:
        for response in responses:
            yield response

    return grpc.unary_stream_rpc_method_handler(
        execute, _tolerant(tool_service_pb2.ExecuteRequest),
        tool_service_pb2.ExecuteResponse.SerializeToString)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.callpath", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--redis", action="store_true", help="the Redis run log")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--layers-only", action="store_true",
                        help="Execute runs no tool: the interceptors' part of the call alone")
    parser.add_argument("--separate", action="store_true",
                        help="also measure the chain unfused (each interceptor on its own)")
    parser.add_argument("--without", action="append", default=[],
                        help="leave this layer (audit, auth, critic) out of the chain")
    parser.add_argument("--concurrent", type=int, default=0, metavar="N",
                        help="bench_wait calls (10 ms), N at once (the concurrent path)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    os.environ.pop("STARGRPC_CONFIG", None)
    with tempfile.TemporaryDirectory(prefix="stargrpc-callpath-") as folder:
        asyncio.run(_measure(args, Path(folder)))


if __name__ == "__main__":
    main()
