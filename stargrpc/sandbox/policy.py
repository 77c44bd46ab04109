"""Isolation policy: whether sandboxed tools may run with the isolation that works here.

A mode that works is not enough. Under ``sandbox_isolation=auto`` the sandboxed tools are
refused (``Result{FAILED}``, ``SANDBOX_UNAVAILABLE``) when the mode picked cannot keep a
run away from the server's secrets:

- commands would run as the server's own user without bubblewrap's private file system
  and PID namespace (``rlimits`` with a non-root server): they could read its state
  folder and ``/proc/<server>/environ``;
- a secret file (state folder, keys file, audit database, TLS key, ``jwt_secret_file``,
  ``fleet_secret_file``) is visible in the mode's view of the file system and readable
  by the sandbox user.

Running them anyway is an explicit choice: ``sandbox_isolation`` set to a mode, or
``sandbox_allow_weak_isolation=true``; both are logged at warning on every start.
``sandbox_isolation_min`` refuses every mode weaker than the one it names.
"""

from __future__ import annotations

import contextlib
import os
import pwd
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from stargrpc.audit.key import audit_key_path
from stargrpc.audit.store import audit_store_url, sqlite_path
from stargrpc.auth.authenticator import keys_path
from stargrpc.sandbox.isolation import (
    _SYSTEM_PATHS,
    MODES,
    Isolation,
    has_permission,
    untraversable,
)
from stargrpc.sandbox.runner import isolation_for, run_ids, sandbox_ids
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.sandbox")

#: What makes bubblewrap work where it is missing or blocked.
BWRAP_FIX = ("install bubblewrap and allow it unprivileged user namespaces (in a container: "
             "see docs/operate/docker.md for the seccomp profile)")


@dataclass(frozen=True)
class SecretPlace:
    """A secret of the server that a sandboxed run could read.

    Attributes:
        what: "keys file", "audit database", …
        path: Where it is.
        fix: The one change that puts it out of reach.
    """

    what: str
    path: str
    fix: str


@dataclass(frozen=True)
class Policy:
    """What sandboxed tools get here, and whether they may run.

    Attributes:
        isolation: The mode that works (None when none does).
        user: Who sandboxed commands run as.
        refusal: Why sandboxed tools are refused, naming the fix; None when they run.
        fix: The change that lets them run, as the refusal names it; None when they run,
            or when the sandbox is unavailable (the refusal says why).
        weak: The mode cannot keep a run away from the server's secrets.
        weak_reasons: Why it is weak.
        reachable: Secrets a run could read in this mode.
        allowed_by: The setting that lets a weak mode run ("sandbox_isolation=rlimits",
            "sandbox_allow_weak_isolation=true"), when one does.
    """

    isolation: Isolation | None
    user: str
    refusal: str | None = None
    fix: str | None = None
    weak: bool = False
    weak_reasons: list[str] = field(default_factory=list)
    reachable: list[SecretPlace] = field(default_factory=list)
    allowed_by: str | None = None


def secret_files(settings: Settings) -> list[tuple[str, Path, str]]:
    """The server's secret files as (what, path, fix)."""
    keep_private = "make it readable by the server's user only (chmod 600) in a folder " \
                   "the sandbox user cannot enter (chmod 700)"
    found = [("state folder", settings.state_dir,
              "chmod 700 the state folder (and run sandboxed commands as another user)"),
             ("keys file", keys_path(settings), keep_private)]
    audit_url = audit_store_url(settings)
    if audit_url.startswith("sqlite:"):
        with contextlib.suppress(ValueError):
            found.append(("audit database", sqlite_path(audit_url), keep_private))
    found.append(("audit key file", audit_key_path(settings), keep_private))
    if settings.tls_key_file is not None:
        found.append(("TLS private key", settings.tls_key_file, keep_private))
    if settings.jwt_secret_file is not None:
        found.append(("JWT secret file", settings.jwt_secret_file, keep_private))
    if settings.fleet_secret_file is not None:
        found.append(("fleet secret file", settings.fleet_secret_file, keep_private))
    if settings.session_forward_key_file is not None:
        found.append(("replica client key", settings.session_forward_key_file, keep_private))
    return found


def sandbox_user_name(settings: Settings) -> str:
    """Who sandboxed commands run as, for people."""
    uid, _ = sandbox_ids(settings)
    if uid is None:
        try:
            me = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            me = f"uid {os.geteuid()}"
        return f"{me} (the server's own user)"
    if settings.sandbox_uids is not None:
        first, last = settings.sandbox_uids
        return f"a user of its own per run (uids {first}-{last})"
    return f"{settings.sandbox_user} (uid {uid})"


def reachable_secrets(settings: Settings, mode: str) -> list[SecretPlace]:
    """The secret files a run in ``mode`` could read (visible in its view of the file
    system and readable by the user it runs as)."""
    uid, gid = run_ids(settings)
    places = []
    for what, path, fix in secret_files(settings):
        if mode == "bwrap" and not _inside_system_paths(path):
            continue
        if _readable(path, uid, gid):
            places.append(SecretPlace(what, str(path), fix))
    return places


def decide(settings: Settings) -> Policy:
    """The policy for sandboxed tools under these settings on this machine."""
    user = sandbox_user_name(settings)
    try:
        isolation = isolation_for(settings)
    except (RuntimeError, OSError) as exc:
        return Policy(None, user, refusal=f"the sandbox is unavailable: {exc}")
    uid, _ = sandbox_ids(settings)
    reasons = []
    if uid is None and isolation.mode != "bwrap":
        reasons.append(f"commands run as the server's own user with the host file system "
                       f"({isolation.mode}): they can read its files and "
                       "/proc/<server>/environ")
    reachable = reachable_secrets(settings, isolation.mode)
    reasons += [f"the {place.what} {place.path} is readable by {user}" for place in reachable]
    weak = bool(reasons)
    minimum = settings.sandbox_isolation_min
    if MODES.index(isolation.mode) > MODES.index(minimum):
        why = "; ".join(f"{mode}: {reason}" for mode, reason in isolation.skipped.items())
        stronger = _stronger_fix(isolation)
        return Policy(isolation, user, weak=weak, weak_reasons=reasons, reachable=reachable,
                      refusal=f"sandbox isolation {isolation.mode} is weaker than "
                      f"sandbox_isolation_min={minimum} ({why}); fix: {stronger}", fix=stronger)
    allowed_by = None
    refusal: str | None = None
    fix: str | None = None
    if weak:
        if settings.sandbox_isolation != "auto":
            allowed_by = f"sandbox_isolation={settings.sandbox_isolation}"
        elif settings.sandbox_allow_weak_isolation:
            allowed_by = "sandbox_allow_weak_isolation=true"
        else:
            fix = (f"{_weak_fix(isolation, reachable, uid)} — or run them anyway with "
                   "sandbox_allow_weak_isolation=true")
            refusal = (f"sandboxed tools are disabled: isolation {isolation.mode} cannot keep "
                       f"a run away from the server's secrets ({'; '.join(reasons)}); fix: "
                       f"{fix}")
    return Policy(isolation, user, refusal=refusal, fix=fix, weak=weak,
                  weak_reasons=reasons, reachable=reachable, allowed_by=allowed_by)


def log_isolation(settings: Settings, tools: Sequence[str] = ()) -> Policy:
    """Decides the policy and says at start-up what sandboxed tools get, and why.

    Args:
        settings: The server's settings.
        tools: Names of the sandboxed tools, for the warnings.
    """
    policy = decide(settings)
    isolation = policy.isolation
    if isolation is None:
        log.error("sandbox_unavailable", error=policy.refusal, tools=list(tools))
        return policy
    if isolation.skipped and settings.sandbox_isolation == "auto":
        log.warning("sandbox_isolation_downgraded", mode=isolation.mode,
                    reasons=dict(isolation.skipped))
    log.info("sandbox_isolation", mode=isolation.mode, protects=isolation.description,
             user=policy.user)
    if policy.refusal is not None:
        log.warning("sandbox_tools_disabled", tools=list(tools), reason=policy.refusal)
    elif policy.weak:
        log.warning("sandbox_weak_isolation", tools=list(tools), mode=isolation.mode,
                    allowed_by=policy.allowed_by, reasons=policy.weak_reasons)
    return policy


def _stronger_fix(isolation: Isolation) -> str:
    if "bwrap" in isolation.skipped:
        return f"{BWRAP_FIX} ({isolation.skipped['bwrap']})"
    return "lower sandbox_isolation_min"


def _weak_fix(isolation: Isolation, reachable: Iterable[SecretPlace], uid: int | None) -> str:
    if isolation.mode != "bwrap":
        return _stronger_fix(isolation) + ("" if uid is not None else
                                           ", or run the server as root so commands run "
                                           "as sandbox_user")
    return "; ".join(f"{place.what}: {place.fix}" for place in reachable)


def _inside_system_paths(path: Path) -> bool:
    real = os.path.realpath(path)
    for shown in _SYSTEM_PATHS:
        target = os.path.realpath(shown)
        if real == target or real.startswith(target.rstrip("/") + "/"):
            return True
    return False


def _readable(path: Path, uid: int | None, gid: int | None) -> bool:
    """Whether the sandbox user can read ``path`` (list it, for a folder). A file not made
    yet counts as readable by the server's own user."""
    if uid is None or gid is None:
        if not os.path.lexists(path):
            return os.access(path.parent, os.X_OK)
        wanted = os.R_OK | (os.X_OK if path.is_dir() else 0)
        return os.access(path, wanted, effective_ids=os.access in os.supports_effective_ids)
    real = Path(os.path.realpath(path))
    if untraversable(real, uid, gid) is not None:
        return False
    try:
        info = real.stat()
    except OSError:
        return False
    if not has_permission(info, uid, gid, 0o4):
        return False
    return not real.is_dir() or has_permission(info, uid, gid, 0o1)
