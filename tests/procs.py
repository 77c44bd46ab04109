"""Server processes for tests that need a real ``stargrpc serve`` (signals, several
replicas, SIGKILL): started on port 0, the bound port read from the "serving" log line."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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

    def __init__(self, args: Sequence[str], env: dict[str, str],
                 prefix: Sequence[str] = ()) -> None:
        self.lines = []
        self._queue: queue.Queue[dict[str, object] | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "stargrpc.cli", "serve", "--port", "0",
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
    """The environment of a test server: its own state folder, auth off (local tests), no
    sandbox warm pool unless asked for (``STARGRPC_SANDBOX_WARM_POOL`` in ``extra``)."""
    env = dict(os.environ)
    env.update({"STARGRPC_STATE_DIR": str(state_dir), "STARGRPC_INSECURE_NO_AUTH": "true",
                "STARGRPC_SHUTDOWN_GRACE_SECONDS": "10", "STARGRPC_SANDBOX_WARM_POOL": "0",
                **extra})
    return env


@contextmanager
def serve(state_dir: Path, *args: str, prefix: Sequence[str] = (),
          **env: str) -> Iterator[ServerProcess]:
    """A running ``stargrpc serve`` for the duration of the block (``prefix``: a command
    the server is started under, e.g. ``setpriv`` to run it as another user)."""
    server = ServerProcess(args, server_env(state_dir, **env), prefix)
    try:
        yield server
    finally:
        server.stop()


#: The uid and gid the container image runs the server as (see the Dockerfile).
IMAGE_UID = 10001


@dataclass
class ImageUser:
    """A server started the way the image runs it: a non-root user, no bubblewrap on PATH.

    Attributes:
        base: A folder of the server's user (mode 0700) holding ``state/`` and ``sandbox/``.
        prefix: The command that starts the server as that user.
        env: Environment variables: PATH without bubblewrap, the state folder, the sandbox
            root.
    """

    base: Path
    prefix: list[str]
    env: dict[str, str]

    @property
    def state_dir(self) -> Path:
        """The server's state folder."""
        return self.base / "state"


@contextmanager
def image_user(uid: int = IMAGE_UID) -> Iterator[ImageUser]:
    """An :class:`ImageUser` (needs root to switch users); removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="stargrpc-image-"))
    try:
        bin_dir = base / "bin"
        bin_dir.mkdir()
        for tool in ("prlimit", "setpriv", "unshare"):  # everything the server looks up
            found = shutil.which(tool)
            if found:
                (bin_dir / tool).symlink_to(found)
        for folder in (base / "state", base / "sandbox"):
            folder.mkdir(mode=0o700)
        for folder in (base, base / "state", base / "sandbox"):
            os.chown(folder, uid, uid)
        base.chmod(0o755)  # the bin folder is reached through it
        yield ImageUser(
            base=base,
            prefix=["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"],
            env={"PATH": str(bin_dir), "STARGRPC_STATE_DIR": str(base / "state"),
                 "STARGRPC_SANDBOX_ROOT": str(base / "sandbox"), "HOME": str(base / "state")})
    finally:
        shutil.rmtree(base, ignore_errors=True)
