"""The sandbox: run a command in a child process with limits, isolation and a clean end.

- :mod:`stargrpc.sandbox.runner` — :class:`Sandbox`, one run from working directory to
  collected output files.
- :mod:`stargrpc.sandbox.outfolder` — the output folder read back as sent files.
- :mod:`stargrpc.sandbox.rlimits` — the rlimits and how a run that hit one is recognised.
- :mod:`stargrpc.sandbox.isolation` — bubblewrap / unshare / rlimits-only, and detection.
- :mod:`stargrpc.sandbox.policy` — whether sandboxed tools may run with the mode that works
  here (fail closed when it cannot keep a run away from the server's secrets).
- :mod:`stargrpc.sandbox.tooling` — :func:`run_in_sandbox`, the one call a tool makes.
- :mod:`stargrpc.sandbox.warm` — a sandbox started ahead of its run: the launcher waiting
  in it, the checks and the nonce of its hand-out.
- :mod:`stargrpc.sandbox.pool` — the warm pool: sandboxes started ahead, each handed to
  exactly one run, refilled in the background.
"""

from __future__ import annotations

from stargrpc.sandbox.isolation import Isolation
from stargrpc.sandbox.outfolder import OutputFile
from stargrpc.sandbox.policy import Policy, decide, log_isolation
from stargrpc.sandbox.rlimits import Limits, Verdict
from stargrpc.sandbox.runner import (
    Sandbox,
    SandboxProcess,
    SandboxResult,
    isolation_for,
)
from stargrpc.sandbox.tooling import run_in_sandbox

__all__ = [
    "Isolation",
    "Limits",
    "OutputFile",
    "Policy",
    "Sandbox",
    "SandboxProcess",
    "SandboxResult",
    "Verdict",
    "decide",
    "isolation_for",
    "log_isolation",
    "run_in_sandbox",
]
