"""The clients of clients/ in other languages, as the tests that run them build them: Go in
GOPATH mode over Debian's libraries, Node.js from its folder; and their command lines run,
their JSON lines read back as the contract's messages."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from google.protobuf import json_format

from stargrpc.v1 import events_pb2

REPO = Path(__file__).resolve().parent.parent
GO_DIR = REPO / "clients" / "go"
GO_PACKAGE = "github.com/stargrpc/stargrpc/clients/go"
NODE_DIR = REPO / "clients" / "node"
BUILD_TIMEOUT = 600
#: How long a client's command line may take.
RUN_TIMEOUT = 60


def go(*args: str, timeout: float = BUILD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """A go command in GOPATH mode over Debian's libraries (clients/go/gopath.sh)."""
    if shutil.which("go") is None:
        pytest.fail("the Go client test needs Go (apt-get install golang-go "
                    "golang-google-grpc-dev golang-google-protobuf-dev "
                    "golang-github-golang-protobuf-1-5-dev)")
    return subprocess.run(["bash", str(GO_DIR / "gopath.sh"), "go", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def build_go(command: str, out_dir: Path) -> str:
    """Builds ``clients/go/cmd/<command>`` into ``out_dir``; the binary's path."""
    binary = out_dir / command
    built = go("build", "-o", str(binary), f"{GO_PACKAGE}/cmd/{command}")
    assert built.returncode == 0, built.stderr
    return str(binary)


def node_cli_command() -> list[str]:
    """``node clients/node/cli.js``, with its dependencies installed (``npm ci``)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("the Node.js client test needs node and npm (apt-get install nodejs npm)")
    npm_ci(NODE_DIR, NODE_DIR / "node_modules" / "@grpc" / "grpc-js")
    return [node, str(NODE_DIR / "cli.js")]


def npm_ci(folder: Path, installed: Path, *, timeout: float = 600) -> None:
    """``npm ci`` in ``folder`` (from its committed lock file) unless ``installed`` exists.
    The folder is locked meanwhile (flock on its descriptor): pytest-xdist's workers may
    ask at once, and two ``npm ci`` in one folder delete each other's files."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(f"the tests of {folder.name} need npm (apt-get install nodejs npm)")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not installed.exists():
            subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                           cwd=folder, check=True, timeout=timeout)
    finally:
        os.close(fd)  # closing the descriptor releases the lock


async def _run(command: Sequence[str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *command, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
    except BaseException:
        # A client that hangs (or a test cancelled meanwhile) must not outlive the test:
        # it would hold its connection to a server the next test may need gone.
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def run_go(go_cli: str, *args: str) -> tuple[int, str, str]:
    """The built ``stargrpc-go`` run with ``args``: its exit code, stdout and stderr."""
    return await _run([go_cli], *args)


async def run_node(node_cli: list[str], *args: str) -> tuple[int, str, str]:
    """``node clients/node/cli.js`` run with ``args``: its exit code, stdout and stderr."""
    return await _run(node_cli, *args)


def json_events(lines: str) -> list[events_pb2.RunEvent]:
    """A client's proto3 JSON lines, read back as the contract's messages: any field the
    client decoded differently would fail here or in the comparisons."""
    return [json_format.ParseDict(json.loads(line), events_pb2.RunEvent())
            for line in lines.splitlines()]
