"""Server processes for tests that need a real ``stargrpc serve`` (signals, several
replicas, SIGKILL): started on port 0, the bound port read from the "serving" log line."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

STARTUP_TIMEOUT = 30.0


class ServerProcess:
    """A ``stargrpc serve`` child process and its JSON log lines.

    Attributes:
        proc: The process.
        port: The gRPC port it bound.
        lines: Every JSON log line read so far (parsed).
    """

    proc: subprocess.Popen[str]
    port: int
    lines: list[dict[str, object]]

    def __init__(self, args: Sequence[str], env: dict[str, str]) -> None:
        self.lines = []
        self._queue: queue.Queue[dict[str, object] | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stargrpc.cli", "serve", "--port", "0",
             "--log-format", "json", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True)
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        serving = self.wait_for(lambda line: line.get("event") == "serving", STARTUP_TIMEOUT)
        self.port = int(str(serving["address"]).rsplit(":", 1)[1])

    @property
    def target(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    def _read(self, stream: IO[str]) -> None:
        for raw in stream:
            try:
                line = json.loads(raw)
            except ValueError:
                line = {"event": "raw", "text": raw.rstrip("\n")}
            if not isinstance(line, dict):
                line = {"event": "raw", "text": raw.rstrip("\n")}
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, predicate: object, timeout: float) -> dict[str, object]:
        """The first log line (already read or still to come) for which ``predicate`` holds.

        Raises:
            AssertionError: The process ended or the timeout passed first.
        """
        assert callable(predicate)
        for line in self.lines:
            if predicate(line):
                return line
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no matching log line within {timeout} s: {self.lines[-20:]}")
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"server exited ({self.proc.poll()}): {self.lines[-20:]}")
            self.lines.append(line)
            if predicate(line):
                return line

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the server."""
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def server_env(state_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a test server: its own state folder, auth off (local tests)."""
    env = dict(os.environ)
    env.update({"STARGRPC_STATE_DIR": str(state_dir), "STARGRPC_INSECURE_NO_AUTH": "true",
                "STARGRPC_SHUTDOWN_GRACE_SECONDS": "10", **extra})
    return env


@contextmanager
def serve(state_dir: Path, *args: str, **env: str) -> Iterator[ServerProcess]:
    """A running ``stargrpc serve`` for the duration of the block."""
    server = ServerProcess(args, server_env(state_dir, **env))
    try:
        yield server
    finally:
        server.stop()
