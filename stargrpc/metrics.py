"""Prometheus metrics of the server, on one registry of their own.

Every module that has something to count imports its metric from here, so the names are
defined once. Serving them over HTTP (``serve --metrics-port``) lives elsewhere.

Under ``serve --workers N`` every process writes its values to files in
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode, chosen by that variable
before this module is imported) and :func:`scrape_registry` adds them up; the gauges say how
(``livesum``: the sum over the processes alive).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

#: The variable that puts prometheus-client in multiprocess mode (see the module docstring).
MULTIPROC_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

#: The registry every stargrpc metric is on (not the process-global default registry, so a
#: test can run several servers in one process without name clashes).
REGISTRY = CollectorRegistry(auto_describe=True)

TASKS_TOTAL = Counter(
    "tool_executor_tasks", "Runs finished, by tool and outcome.", ["tool", "outcome"],
    registry=REGISTRY)
DURATION_SECONDS = Histogram(
    "tool_executor_duration_seconds", "Wall time of runs, by tool.", ["tool"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
    registry=REGISTRY)
#: The receipt's figures (``Result.usage``), by tool: observed only for runs that measure
#: them (sandboxed runs; an in-process tool's CPU and memory are not measured).
RUN_CPU_SECONDS = Histogram(
    "stargrpc_run_cpu_seconds", "CPU time (user + system) of a run's process tree, by tool; "
    "runs that do not measure it are not observed.", ["tool"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
    registry=REGISTRY)
RUN_PEAK_MEMORY_BYTES = Histogram(
    "stargrpc_run_peak_memory_bytes", "Peak resident memory of the largest process of a "
    "run's tree, by tool; runs that do not measure it are not observed.", ["tool"],
    buckets=tuple(float(2 ** power) for power in range(22, 35)),  # 4 MiB … 16 GiB
    registry=REGISTRY)
#: The sandbox warm pool (stargrpc/sandbox/pool.py), by warm kind ("python", "exec").
POOL_READY = Gauge(
    "stargrpc_sandbox_pool_ready", "Warm sandboxes started ahead and waiting for a run, by "
    "kind (each process keeps its own pool).", ["kind"], registry=REGISTRY,
    multiprocess_mode="livesum")
POOL_HANDOUTS = Counter(
    "stargrpc_sandbox_pool_handouts", "Runs given a warm sandbox from the pool, by kind.",
    ["kind"], registry=REGISTRY)
POOL_MISSES = Counter(
    "stargrpc_sandbox_pool_misses", "Runs a warm sandbox would have fitted that found the "
    "pool empty and started their own, by kind.", ["kind"], registry=REGISTRY)
POOL_DISCARDED = Counter(
    "stargrpc_sandbox_pool_discarded", "Warm sandboxes destroyed without serving a run, by "
    "kind and reason (died: exited while waiting; tampered: touched while waiting or did "
    "not answer the hand-out; setup_failed: the run's input files could not be written, "
    "a full disk say; abandoned: the run was cancelled at hand-out).",
    ["kind", "reason"], registry=REGISTRY)
RUNS_IN_FLIGHT = Gauge(
    "tool_executor_runs_in_flight", "Runs started and not yet ended.", registry=REGISTRY,
    multiprocess_mode="livesum")
EVENTS_STREAMED = Counter(
    "tool_executor_events_streamed", "Run events sent to clients, by RPC.", ["rpc"],
    registry=REGISTRY)
CRITIC_EXTENSIONS = Counter(
    "tool_executor_critic_extensions", "Soft deadlines restarted by progress.",
    registry=REGISTRY)
CRITIC_WARNINGS = Counter(
    "tool_executor_critic_warnings", "No-progress warnings sent at half the soft deadline.",
    registry=REGISTRY)
CRITIC_KILLS = Counter(
    "tool_executor_critic_kills", "Runs stopped by the critic, by reason.", ["reason"],
    registry=REGISTRY)
CRITIC_VERDICTS = Counter(
    "tool_executor_critic_verdicts", "Verdicts applied to runs (extend, warn, steer, stop, "
    "keep, and fallback when a critic was dropped for the rules), by critic.",
    ["verdict", "critic"], registry=REGISTRY)
AUTH_FAILURES = Counter(
    "tool_executor_auth_failures", "Calls refused by authentication or permissions, by reason.",
    ["reason"], registry=REGISTRY)
AUDIT_QUEUE_DEPTH = Gauge(
    "tool_executor_audit_queue_depth", "Audit records waiting to be written.",
    registry=REGISTRY, multiprocess_mode="livesum")
AUDIT_RECORDS_REFUSED = Counter(
    "stargrpc_audit_records_refused", "Audit records the audit store refused for their "
    "content, each replaced in the trail by a substitute saying so (the record itself is in "
    "the log line audit_record_refused).", registry=REGISTRY)
DELIVERY_ATTEMPTS = Counter(
    "tool_executor_delivery_attempts", "Attempts to deliver a Result, by target kind and "
    "result (ok, failed).", ["kind", "result"], registry=REGISTRY)
DELIVERIES = Counter(
    "tool_executor_deliveries", "Results whose delivery ended, by target kind and final "
    "state (delivered, failed).", ["kind", "state"], registry=REGISTRY)
#: Lanes (stargrpc/runs/lanes.py). The depth is the lane's whole queue as this process
#: sees it: in a fleet every replica sees the same queue, so workers report their largest.
LANE_QUEUE_DEPTH = Gauge(
    "stargrpc_lane_queue_depth", "Runs waiting in a lane's queue, by lane.", ["lane"],
    registry=REGISTRY, multiprocess_mode="livemax")
LANE_WAIT_SECONDS = Histogram(
    "stargrpc_lane_wait_seconds", "Time runs waited in their lane's queue before they "
    "started (0 for a run that found a slot free), by lane.", ["lane"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
    registry=REGISTRY)
LANE_REFUSALS = Counter(
    "stargrpc_lane_refusals_total", "Calls a lane refused before their run started, by lane "
    "and reason (lane_full, lane_busy).", ["lane", "reason"], registry=REGISTRY)
#: Human approval (stargrpc/runs/approval.py), counted by the process holding the run.
APPROVAL_REQUESTS = Counter(
    "stargrpc_approval_requests_total", "Runs that asked a person's approval before they "
    "started, by tool.", ["tool"], registry=REGISTRY)
APPROVAL_DECISIONS = Counter(
    "stargrpc_approval_decisions_total", "Approval requests that ended, by how (approved, "
    "denied, timeout; withdrawn: the run ended, or its call was refused, while it waited).",
    ["decision"], registry=REGISTRY)
APPROVAL_WAIT_SECONDS = Histogram(
    "stargrpc_approval_wait_seconds", "Time from an approval request to its end, by how it "
    "ended (as for stargrpc_approval_decisions_total).", ["decision"],
    buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
    registry=REGISTRY)
APPROVALS_PENDING = Gauge(
    "stargrpc_approvals_pending", "Runs of this process waiting for a person's approval.",
    registry=REGISTRY, multiprocess_mode="livesum")
RUNS_LOST = Counter(
    "tool_executor_runs_lost", "Runs of replicas that stopped responding that this replica "
    "ended RUN_LOST, by what noticed (sweep: the background sweep; call: a watch, a retry "
    "or a delivery looking at the run).", ["noticed_by"], registry=REGISTRY)

#: Set by a fleet replica only (label ``store``: ``redis``), so an embedded server shows none.
RUN_STORE_REACHABLE = Gauge(
    "stargrpc_run_store_reachable", "Whether the shared run store answers this process "
    "(1) or not (0: its health is NOT_SERVING), by store; under --workers the lowest.",
    ["store"], registry=REGISTRY, multiprocess_mode="livemin")


def scrape_registry() -> CollectorRegistry:
    """What ``/metrics`` serves: :data:`REGISTRY`, or in multiprocess mode a registry that
    adds up the values every worker process wrote."""
    folder = os.environ.get(MULTIPROC_DIR_VARIABLE)
    if not folder:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    return registry
