"""``stargrpc serve --workers N``: N server processes on one port, supervised by the first.

One Python process runs its interpreter on one core. With ``workers`` > 1 the process started
by ``stargrpc serve`` becomes a supervisor that serves no call itself:

- Before any worker exists it does what must happen exactly once: the first admin key (in
  ``stargrpc serve``), the audit key file, the ports. It binds every port it will hand out
  with ``SO_REUSEPORT`` and keeps the sockets (bound, never listening), so port 0 becomes
  one port that all workers share and no other program takes it between two restarts.
- It starts each worker as a fresh interpreter (``python -m stargrpc.server.workers``). gRPC and
  uvicorn listen with ``SO_REUSEPORT`` in every worker, so the kernel spreads connections
  over them; runs, WatchRun, CancelRun and idempotency keys live in the Redis run store,
  which every worker shares (``redis_url`` is required); the audit trail is one SQLite file
  or PostgreSQL database, written by all.
- The settings reach a worker through an inherited anonymous memory file, not through its
  environment or command line: secrets (handed over by :mod:`stargrpc.secret_env` or still
  in the supervisor's environment) never appear in a worker's ``/proc/<pid>/environ``.
- Metrics use prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``): every
  worker writes its values to files there and every worker's ``/metrics`` adds them up.
- A worker that dies is logged and started again after a backoff; one that cannot start
  for a configuration reason (exit status 3 or 4) stops them all. SIGTERM or SIGINT drains
  every worker (each one as a single server drains) and the supervisor exits once they
  have; SIGHUP reloads every worker's catalog.
- A worker still starting takes a SIGHUP as a reload too, never as the signal's default
  action (which ends the process): it is started with SIGHUP blocked, and unblocks it once
  its event loop handles it, so one that came meanwhile waits and is then applied (see
  :func:`_serve`). One that reaches the supervisor while it is starting a worker is sent to
  that worker as soon as the worker is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from stargrpc.audit.key import audit_key_path, load_or_create_key
from stargrpc.metrics import MULTIPROC_DIR_VARIABLE
from stargrpc.secret_env import (
    HANDOVER_VARIABLE,
    read_handover,
    secret_variables,
    write_handover,
)
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.workers")

#: Names, in a worker's environment, the inherited memory file holding its settings.
SETTINGS_FD_VARIABLE = "_STARGRPC_WORKER_SETTINGS_FD"
#: A worker's number (0 … N-1) in its environment; it tags the worker's log lines.
INDEX_VARIABLE = "_STARGRPC_WORKER"
#: The supervisor's process id in a worker's environment (the worker exits when it is gone).
PARENT_VARIABLE = "_STARGRPC_WORKER_PARENT"

#: Exit statuses of ``stargrpc serve`` that mean the configuration cannot work: restarting
#: the worker would only fail again.
CANNOT_START = (3, 4)
#: First and longest wait before a dead worker is started again; the wait doubles with each
#: death in a row and resets once a worker has lived :data:`STABLE_SECONDS`.
RESTART_BACKOFF_SECONDS = (0.5, 30.0)
STABLE_SECONDS = 30.0
#: What a worker gets beyond the drain itself (the transport's last flush, the audit
#: writer's close) before the supervisor kills it.
STOP_MARGIN_SECONDS = 10.0

_PR_SET_PDEATHSIG = 1


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    deaths_in_a_row: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class WorkerSupervisor:
    """Starts, restarts, reloads and drains the worker processes of one server.

    Attributes:
        settings: The supervisor's settings (``workers`` of them are started).
        exit_status: What ``stargrpc serve`` exits with once :meth:`run` returns.
    """

    settings: Settings
    exit_status: int
    _overrides: dict[str, Any]
    _config_file: Path | None
    _workers: list[_Worker]
    _reserved: list[socket.socket]
    _metrics_dir: Path | None
    _own_metrics_dir: bool
    _stopping: asyncio.Event
    _reloads: int

    def __init__(self, settings: Settings, overrides: dict[str, Any],
                 config_file: Path | None) -> None:
        """A supervisor for ``settings.workers`` workers.

        Args:
            settings: The settings the supervisor resolved.
            overrides: The flags and handed-over values ``settings`` was loaded with: each
                worker loads its settings from these, the same environment and config file.
            config_file: ``--config``.
        """
        self.settings = settings
        self.exit_status = 0
        self._overrides = dict(overrides)
        self._config_file = config_file
        self._workers = [_Worker(index) for index in range(settings.workers)]
        self._reserved = []
        self._metrics_dir = None
        self._own_metrics_dir = False
        self._reloads = 0

    async def run(self) -> int:
        """Runs the workers until SIGTERM/SIGINT has drained them all.

        Returns:
            The exit status: 0 after a clean drain.

        Raises:
            OSError: A port cannot be bound.
            AuditKeyError: The audit key file cannot be made or read.
        """
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        try:
            self._prepare()
            log.info("workers_starting", workers=len(self._workers),
                     address=f"{self.settings.host}:{self._overrides['port']}")
            for worker in self._workers:
                worker.task = asyncio.create_task(self._keep_running(worker))
            await asyncio.gather(*(w.task for w in self._workers if w.task is not None))
        finally:
            for reserved in self._reserved:
                reserved.close()
            if self._own_metrics_dir and self._metrics_dir is not None:
                shutil.rmtree(self._metrics_dir, ignore_errors=True)
        log.info("workers_stopped", exit_status=self.exit_status)
        return self.exit_status

    # -- once, before the first worker ---------------------------------------------------------
    def _prepare(self) -> None:
        s = self.settings
        # Made here, so workers starting together read one key instead of racing to make it.
        load_or_create_key(audit_key_path(s))
        self._overrides["port"] = self._reserve(s.host, s.port)
        for name, host in (("http_port", s.http_host), ("metrics_port", s.metrics_host),
                           ("mcp_port", s.mcp_host)):
            port = getattr(s, name)
            if port is not None:
                self._overrides[name] = self._reserve(host or s.host, port)
        given = os.environ.get(MULTIPROC_DIR_VARIABLE)
        if given:
            self._metrics_dir = Path(given)
            self._metrics_dir.mkdir(parents=True, exist_ok=True)
            for stale in self._metrics_dir.glob("*.db"):  # a previous run's counts
                stale.unlink(missing_ok=True)
        else:
            self._metrics_dir = Path(tempfile.mkdtemp(prefix="stargrpc-metrics-"))
            self._own_metrics_dir = True

    def _reserve(self, host: str, port: int) -> int:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
        except OSError:
            sock.close()
            raise
        self._reserved.append(sock)
        return int(sock.getsockname()[1])

    # -- the workers -----------------------------------------------------------------------------
    def _environment(self) -> tuple[dict[str, str], dict[str, str]]:
        """A worker's environment (no secrets) and the secrets taken out of it."""
        secrets = secret_variables(os.environ)
        environ = {k: v for k, v in os.environ.items()
                   if k not in secrets and k != HANDOVER_VARIABLE}
        environ[MULTIPROC_DIR_VARIABLE] = str(self._metrics_dir)
        environ[PARENT_VARIABLE] = str(os.getpid())
        return environ, {name[len("STARGRPC_"):].lower(): value
                         for name, value in secrets.items()}

    async def _spawn(self, worker: _Worker) -> asyncio.subprocess.Process:
        environ, secrets = self._environment()
        payload = {"config_file": str(self._config_file) if self._config_file else None,
                   "overrides": {**secrets, **self._overrides}}
        fd = write_handover("stargrpc-worker-settings", payload)
        try:
            environ[SETTINGS_FD_VARIABLE] = str(fd)
            environ[INDEX_VARIABLE] = str(worker.index)
            reloads = self._reloads
            # The child inherits the blocked signal through fork and exec; the fork happens
            # before this await first suspends, so unblocking after it is soon enough. A
            # SIGHUP sent to the supervisor meanwhile waits, or reaches another thread.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
            try:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "stargrpc.server.workers", env=environ, pass_fds=(fd,))
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        finally:
            os.close(fd)
        worker.process = process
        worker.started = time.monotonic()
        log.info("worker_started", worker=worker.index, pid=process.pid)
        if self._reloads != reloads:  # reloaded before the worker was known: it reloads too
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGHUP)
        return process

    async def _keep_running(self, worker: _Worker) -> None:
        while not self._stopping.is_set():
            process = await self._spawn(worker)
            status = await process.wait()
            _mark_process_dead(process.pid, self._metrics_dir)
            if self._stopping.is_set():
                # A worker still starting up may die of the SIGTERM itself: nothing lost.
                if status not in (0, -signal.SIGTERM):
                    self.exit_status = self.exit_status or 1
                log.info("worker_stopped", worker=worker.index, pid=process.pid,
                         status=_describe(status))
                return
            lived = time.monotonic() - worker.started
            if status in CANNOT_START:
                log.error("worker_cannot_start", worker=worker.index, pid=process.pid,
                          status=status)
                self.exit_status = status
                self._stop()
                return
            worker.deaths_in_a_row = 1 if lived >= STABLE_SECONDS else worker.deaths_in_a_row + 1
            first, longest = RESTART_BACKOFF_SECONDS
            delay = min(longest, first * 2 ** (worker.deaths_in_a_row - 1))
            log.error("worker_exited", worker=worker.index, pid=process.pid,
                      status=_describe(status), lived_seconds=round(lived, 3),
                      restart_in_seconds=delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    def _live(self) -> list[asyncio.subprocess.Process]:
        return [w.process for w in self._workers
                if w.process is not None and w.process.returncode is None]

    def _signal_all(self, sig: int) -> None:
        for process in self._live():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)

    def _stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        log.info("workers_stopping", workers=len(self._live()))
        self._signal_all(signal.SIGTERM)
        asyncio.get_running_loop().call_later(
            self.settings.shutdown_grace_seconds + self.settings.audit_close_timeout_seconds
            + STOP_MARGIN_SECONDS, self._kill_stragglers)

    def _kill_stragglers(self) -> None:
        for process in self._live():
            log.error("worker_killed", pid=process.pid, reason="did not drain in time")
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    def _reload(self) -> None:
        self._reloads += 1
        log.info("workers_reloading", workers=len(self._live()))
        self._signal_all(signal.SIGHUP)


def _mark_process_dead(pid: int, folder: Path | None) -> None:
    # Only the live gauges' files go: counters and histograms keep what the dead worker did.
    if folder is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(folder))


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


# -- in a worker -------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """A worker drains (SIGTERM) when its supervisor is gone, however it went."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.environ.pop(PARENT_VARIABLE, "")
    if parent and os.getppid() != int(parent):  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _read_payload() -> tuple[Path | None, dict[str, Any]]:
    payload = read_handover(SETTINGS_FD_VARIABLE)
    config = payload.get("config_file")
    return (Path(config) if config else None), dict(payload["overrides"])


async def _serve(server_class: Any, settings: Settings) -> None:
    """Serves until stopped. SIGHUP, blocked since the supervisor forked this process,
    is unblocked once the loop handles it: a reload that came while the interpreter started
    is delivered then, and one that comes while the catalog loads is applied once it is
    loaded (by the handler :meth:`~stargrpc.server.StargrpcServer.serve_forever` puts in
    place), so a change made while the worker started is never missed."""
    server: Any = None

    def reload_early() -> None:
        if server is not None:  # else the catalog is yet to be loaded: it will be current
            server.reload_tools()

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_early)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    # Made inside the loop: a grpc.aio server belongs to the loop running when it is made.
    server = server_class(settings)
    await server.serve_forever()


def _exit_before_serving(signum: int, frame: object) -> None:
    raise SystemExit(0)


def worker_main() -> None:
    """The entry point of a worker process (``python -m stargrpc.server.workers``)."""
    # Until the server's own handlers are in, a stop request ends a worker that serves
    # nothing yet.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_before_serving)
    from pydantic import ValidationError

    from stargrpc.audit.key import AuditKeyError
    from stargrpc.errors import AuthConfigError, ToolDefinitionError
    from stargrpc.logs import configure_logging
    from stargrpc.server.grpc_server import StargrpcServer

    _die_with_parent()
    index = int(os.environ.pop(INDEX_VARIABLE, "0"))
    config_file, overrides = _read_payload()
    try:
        settings = Settings.load(config_file, **overrides)
    except ValidationError as exc:
        print(f"stargrpc worker {index}: invalid settings:\n{exc}", file=sys.stderr)
        sys.exit(4)
    configure_logging(settings.log_level, settings.log_format, cache=True)
    structlog.contextvars.bind_contextvars(worker=index)
    try:
        asyncio.run(_serve(StargrpcServer, settings))
    except ToolDefinitionError as exc:
        log.error("tools_failed_to_load", error=str(exc))
        sys.exit(3)
    except (OSError, AuditKeyError, AuthConfigError) as exc:
        log.error("cannot_start", error=str(exc))
        sys.exit(4)


if __name__ == "__main__":
    worker_main()
