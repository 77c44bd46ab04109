"""Writes the seccomp profile the stargrpc image needs for bubblewrap: Docker's default
profile plus the system calls bubblewrap makes to build its sandbox.

Docker's default profile allows ``clone`` with namespace flags, ``unshare``, ``mount``,
``umount2``, ``pivot_root`` and ``sethostname`` only to containers granted CAP_SYS_ADMIN.
bubblewrap, run by the image's unprivileged user, makes them inside a user namespace it
creates itself, where it holds those rights over nothing but its own namespaces. Granting
the container CAP_SYS_ADMIN (or dropping seccomp altogether) would give far more.

Usage (the default profile of *your* Docker version is the right base)::

    curl -fsSLo docker-default.json \\
      https://raw.githubusercontent.com/moby/moby/master/profiles/seccomp/default.json
    python3 deploy/seccomp_profile.py docker-default.json > stargrpc-seccomp.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

#: What bubblewrap calls to make its namespaces, mounts and new root.
BWRAP_SYSCALLS = ("clone", "unshare", "mount", "umount", "umount2", "pivot_root",
                  "sethostname", "chroot")


def with_bwrap(profile: dict[str, Any]) -> dict[str, Any]:
    """``profile`` with every conditional rule on :data:`BWRAP_SYSCALLS` replaced by one
    unconditional allow rule (``clone3`` keeps its ENOSYS answer: C libraries then fall
    back to ``clone``)."""
    rules = []
    for rule in profile["syscalls"]:
        names = [name for name in rule["names"] if name not in BWRAP_SYSCALLS]
        if names:
            rules.append({**rule, "names": names})
    rules.append({"names": list(BWRAP_SYSCALLS), "action": "SCMP_ACT_ALLOW",
                  "comment": "bubblewrap: user, mount, PID, network and UTS namespaces"})
    return {**profile, "syscalls": rules}


def main(argv: list[str]) -> int:
    """Reads the default profile named by ``argv[1]``, prints the result."""
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as handle:
        profile = json.load(handle)
    json.dump(with_bwrap(profile), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
