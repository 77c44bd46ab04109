"""Test a tool: run it in-process with :func:`run_tool`, or behind a real server with
:func:`serve`, and look at what it did through a :class:`RecordedRun`.

::

    from stargrpc.testing import run_tool
    from tools.count import count

    async def test_count():
        recorded = await run_tool(count, {"to": 2})
        assert recorded.outcome is Outcome.OK
        assert recorded.deltas == "1\\n2\\n"

:func:`run_tool` goes through the same machinery as a server (argument validation, the
permission policy of the settings, the run pipeline with its supervision by the critic,
the run's event log, outcome classification, the audit view), so what passes here behaves
the same behind gRPC. :func:`serve` starts a real server on ``127.0.0.1:0`` and gives a
connected client; the pytest plugin (:mod:`stargrpc.testing.pytest_plugin`) offers it as
the ``stargrpc_server`` fixture.
"""

from __future__ import annotations

from stargrpc.testing._harness import (
    TEST_PRINCIPAL,
    RecordedRun,
    ServedTools,
    StepNode,
    load_tool_module,
    record,
    run_tool,
    run_tool_sync,
    serve,
    serve_tools,
)

__all__ = [
    "TEST_PRINCIPAL", "RecordedRun", "ServedTools", "StepNode", "load_tool_module", "record",
    "run_tool", "run_tool_sync", "serve", "serve_tools",
]
