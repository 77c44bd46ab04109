"""Starts a stargrpc server with some layers of the interceptor chain left out, to measure
what each layer costs: ``python -m bench.launch --without audit --tools-dir bench/tools``.

Everything else is what ``stargrpc serve`` does: the same settings (environment and
flags), the same logging, the same server. A layer is named by the last part of its
interceptor's module (``stargrpc.server.interceptors.audit`` → ``audit``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from stargrpc.logs import configure_logging
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors import build_chain
from stargrpc.settings import Settings


def layer_of(interceptor: grpc.aio.ServerInterceptor) -> str:
    """The layer name of an interceptor: the last part of its class's module."""
    return type(interceptor).__module__.rsplit(".", 1)[-1]


def chain_without(settings: Settings, without: Sequence[str]
                  ) -> list[grpc.aio.ServerInterceptor]:
    """The server's interceptor chain minus the layers named in ``without``; a name that is
    no layer of the chain is refused (a typo would otherwise measure the whole chain)."""
    chain = [(layer_of(i), i) for i in build_chain(settings)]
    left_out = set(without)
    unknown = left_out - {layer for layer, _ in chain}
    if unknown:
        raise SystemExit(f"bench.launch: no layer {', '.join(sorted(unknown))} in the chain "
                         f"(it has: {', '.join(layer for layer, _ in chain)})")
    return [i for layer, i in chain if layer not in left_out]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.launch")
    parser.add_argument("--without", action="append", default=[],
                        help="Leave out this layer of the interceptor chain (repeatable).")
    parser.add_argument("--tools-dir", action="append", type=Path, default=[])
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--list-layers", action="store_true",
                        help="Print the layers of the full chain as JSON and exit.")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {"port": args.port}
    if args.list_layers:
        print(json.dumps({"layers": asyncio.run(_layers(Settings.load()))}))
        return
    if args.tools_dir:
        overrides["tools_dir"] = args.tools_dir
    settings = Settings.load(**overrides)
    configure_logging(settings.log_level, settings.log_format, cache=True)
    asyncio.run(_serve(settings, args.without))


async def _layers(settings: Settings) -> list[str]:
    return [layer_of(i) for i in build_chain(settings)]


async def _serve(settings: Settings, without: Sequence[str]) -> None:
    server = StargrpcServer(settings, interceptors=chain_without(settings, without))
    await server.serve_forever()


if __name__ == "__main__":
    main()
