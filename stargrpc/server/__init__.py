"""The gRPC face: where a call comes in.

- ``grpc_server.py``: :class:`StargrpcServer` — ToolService, health, reflection, an orderly
  shutdown — and its wiring (``build_runtime``, ``tune_garbage_collector``);
- ``service.py``: ToolService, mapping the protobuf contract onto the run core
  (:mod:`stargrpc.runs`) and nothing else; ``streaming.py``: how events go out on streams;
- ``interceptors/``: tracing, audit, authentication and the critic's supervision policy;
- ``reflection.py``: server reflection with the contract's comments;
- ``workers.py``: ``serve --workers N``, the supervisor of worker processes.

The server's names resolve here too (``stargrpc.server.StargrpcServer``), loaded on first
use so that importing one module of this package does not load the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = frozenset({"GC_THRESHOLDS", "Lifecycle", "StargrpcServer", "build_runtime",
                    "load_tools", "tune_garbage_collector"})


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'stargrpc.server' has no attribute {name!r}")
    value = getattr(importlib.import_module("stargrpc.server.grpc_server"), name)
    globals()[name] = value
    return value
