"""The clients of clients/ in other languages, as the tests that run them build them: Go in
GOPATH mode over Debian's libraries, Node.js from its folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GO_DIR = REPO / "clients" / "go"
GO_PACKAGE = "github.com/stargrpc/stargrpc/clients/go"
NODE_DIR = REPO / "clients" / "node"
BUILD_TIMEOUT = 600


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
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=NODE_DIR, check=True, timeout=600)
    return [node, str(NODE_DIR / "cli.js")]
