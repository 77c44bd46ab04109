"""The run core: where a run lives, from admission to its Result.

Nothing here speaks gRPC; the faces that take calls (``stargrpc.server`` for gRPC, the HTTP
gateway, the MCP endpoint, the test harness) hand a decoded request to
:class:`~stargrpc.runs.runtime.Runtime`, and every entry point passes the same pipeline.

- ``runtime.py``: admitting a run (lookup, permissions, arguments, idempotency, limits) and
  the run pipeline (``RunInterceptor``: the critic, the permission gate, the audit view);
- ``run.py``: one run's lifecycle and its event log; ``context.py``: what a tool sees;
- admission's parts: ``permissions.py`` (who may run a tool), ``arguments.py`` (decoding and
  validation), ``idempotency.py`` (keys), ``concurrency.py`` (runs in flight);
- a run's output: ``outcome.py`` (what a return or exception means), ``event_sizes.py``
  (every event under the send limit), ``usage.py`` (its receipt, ``Result.usage``);
- ``lanes.py``: when a run may start — its lane and priority, the lane's queue (turns between
  principals, the estimated wait) and the gate a queued run waits in (``Run.gates``);
- ``call_record.py``: the record of one call attempt, shared along the interceptors;
- ``state.py``: run state (``ctx.state``), scoped to a run, its tree, its caller or global,
  kept in the run store's ``state`` (:class:`~stargrpc.stores.base.StateStore`).

Rooms still to come sit beside these, each with its seam named in the runtime: approval
(whether a run may start: a gate before the lane's), trees (``parent_run_id``;
``Run.root_run_id``, which the ``tree`` state scope already names, is the run's own id until
then), and sessions.
"""
