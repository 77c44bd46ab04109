"""Secrets given as environment variables, taken out of the server's environment.

Linux shows a process's *initial* environment in ``/proc/<pid>/environ`` for as long as it
lives: ``os.environ.pop`` or ``unsetenv`` change a copy, not that block. So ``stargrpc
serve``, started with a secret in ``STARGRPC_*`` (a secret setting such as
``STARGRPC_JWT_SECRET``, or a URL with a password such as ``STARGRPC_REDIS_URL``), re-executes
itself once — same process id, same arguments — with those variables removed from the new
environment, and hands their values over through an anonymous memory file (``memfd``)
inherited by the new program, which reads and closes it before anything else starts.

It protects the secret from what reads ``/proc/<server>/environ``: processes of the same
user (a sandboxed run with weak isolation) and tools that dump environments. It does not
protect it from the place that set the variable (a shell history, ``docker inspect``, a
Kubernetes pod spec) or from a process allowed to read the server's memory.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

from stargrpc.settings import Settings, url_has_password

#: Names the inherited memory file in the re-executed program's environment.
HANDOVER_VARIABLE = "_STARGRPC_SECRETS_FD"
_PREFIX = "STARGRPC_"


def secret_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``STARGRPC_*`` variables of ``environ`` that hold a secret, by name."""
    secret_fields = _secret_fields()
    found = {}
    for name, value in environ.items():
        if not name.upper().startswith(_PREFIX):
            continue
        field = name[len(_PREFIX):].lower()
        if field in secret_fields or url_has_password(value):
            found[name] = value
    return found


def hand_over_and_reexec(argv: list[str] | None = None) -> str | None:
    """Re-executes this process without its secret variables, handing them over.

    Returns only when there is nothing to hand over (None), or when the re-exec failed
    (why; the environment stays as it was).

    Args:
        argv: The command line to re-execute; default the original one.
    """
    secrets = secret_variables(os.environ)
    if not secrets or HANDOVER_VARIABLE in os.environ:
        return None
    fd = write_handover("stargrpc-secrets", secrets)
    os.set_inheritable(fd, True)
    environ = {k: v for k, v in os.environ.items() if k not in secrets}
    environ[HANDOVER_VARIABLE] = str(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # The running binary itself: its path may not be reachable by the server's user
        # (an interpreter under a private folder, entered with capabilities since dropped).
        # argv[0] keeps the virtual environment's interpreter path, which Python reads its
        # prefix from.
        os.execve("/proc/self/exe", argv or [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError as exc:
        os.close(fd)
        return f"{', '.join(sorted(secrets))} stay in /proc/{os.getpid()}/environ: {exc}"


def take_over() -> dict[str, str]:
    """In the re-executed program: the handed-over secrets as setting overrides (field name
    → value); empty when none were. The memory file is closed, the variable removed."""
    try:
        secrets = read_handover(HANDOVER_VARIABLE)
    except (OSError, ValueError):
        return {}
    if not isinstance(secrets, dict):  # none, or not what this program hands over
        return {}
    return {name[len(_PREFIX):].lower(): str(value) for name, value in secrets.items()
            if isinstance(name, str) and name.upper().startswith(_PREFIX)}


def write_handover(name: str, payload: Any) -> int:
    """An anonymous memory file holding ``payload`` as JSON, read from its start: for a
    program started next (execve, or a child given it in ``pass_fds``) to read with
    :func:`read_handover`, its number in an environment variable. Values JSON does not know
    are written as text. The caller closes it.

    Args:
        name: The file's name (shown in ``/proc/<pid>/fd``).
        payload: What to hand over.
    """
    fd = os.memfd_create(name, 0)
    try:
        os.write(fd, json.dumps(payload, default=str).encode())
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_handover(variable: str) -> Any:
    """What :func:`write_handover` wrote, in the memory file whose number is in the
    environment ``variable``; None when it is not set. The variable is removed and the file
    closed.

    Raises:
        OSError: The number is not an open file.
        ValueError: The variable is not a number, or the file holds no JSON.
    """
    raw = os.environ.pop(variable, None)
    if raw is None:
        return None
    with os.fdopen(int(raw), "rb") as handle:
        return json.loads(handle.read())


@functools.cache
def _secret_fields() -> frozenset[str]:
    """The settings whose type is a secret."""
    return frozenset(name for name, info in Settings.model_fields.items()
                     if info.annotation is not None and SecretStr in _members(info.annotation))


def _members(annotation: object) -> tuple[object, ...]:
    return (annotation, *getattr(annotation, "__args__", ()))
