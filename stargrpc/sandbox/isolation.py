"""Isolation modes: which wrapper a sandboxed command runs in, and how that is detected.

- ``bwrap`` (bubblewrap): private network (loopback only), private PID namespace (the
  whole tree dies with the run), a read-only view of the system folders only (``/usr``,
  ``/etc`` …; no ``/home``, ``/root``, ``/var``, ``/srv``, host ``/tmp``), a private
  ``/tmp`` and ``/dev``, the run's working directory the only writable place.
- ``unshare`` (util-linux, needs root): private network and PID namespace; the file
  system is the host's, protected only by running as the unprivileged sandbox user.
- ``rlimits``: resource limits, a scrubbed environment, its own session, the sandbox user
  when the server is root; no namespace at all.

Each mode is probed once per process by actually running ``true`` in it.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Host folders shown read-only inside bubblewrap (symlinks are recreated as symlinks).
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
                 "/opt")

#: Where the run's working directory appears inside bubblewrap.
BWRAP_WORKDIR = "/work"

MODES = ("bwrap", "unshare", "rlimits")


@dataclass(frozen=True)
class Isolation:
    """An isolation mode that works on this machine.

    Attributes:
        mode: "bwrap", "unshare" or "rlimits".
        description: What it protects, one line, for the start-up log.
        skipped: Stronger modes that were tried first and why each does not work here.
    """

    mode: str
    description: str
    skipped: Mapping[str, str] = field(default_factory=dict, compare=False)

    def command(self, argv: Sequence[str], workdir: Path, *, limits: Sequence[str],
                uid: int | None, gid: int | None,
                tmpfs_bytes: int | None = None,
                read_only_paths: Sequence[Path] = ()) -> list[str]:
        """The full command line that runs ``argv`` in this mode.

        The sandbox user is taken with ``setpriv`` on the command line rather than by the
        forking process: changing ids makes Python fork() instead of vfork(), and a fork of
        a process full of gRPC threads can crash before it reaches exec.

        Args:
            argv: The command.
            workdir: The run's working directory on the host.
            limits: The ``prlimit`` prefix.
            uid: The sandbox user, when the server is root.
            gid: The sandbox group.
            tmpfs_bytes: Size of each private tmpfs (bubblewrap's ``/tmp``, ``/dev/shm``).
            read_only_paths: Host folders shown read-only at the same path inside
                bubblewrap (the other modes see the host's file system anyway).
        """
        drop: list[str] = []
        if uid is not None and gid is not None:
            drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                    "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--"]
        if self.mode == "bwrap":
            return [*drop, *limits, *_bwrap_prefix(workdir, tmpfs_bytes, read_only_paths),
                    "--", *argv]
        if self.mode == "unshare":
            # unshare needs root to make the namespaces; the ids are dropped inside.
            return [*limits, "unshare", "--net", "--pid", "--fork", "--kill-child",
                    "--mount-proc", "--", *drop, *argv]
        return [*drop, *limits, *argv]

    def workdir_inside(self, workdir: Path) -> str:
        """The path of the working directory as the command sees it."""
        return BWRAP_WORKDIR if self.mode == "bwrap" else str(workdir)


def _bwrap_prefix(workdir: Path, tmpfs_bytes: int | None = None,
                  read_only_paths: Sequence[Path] = ()) -> list[str]:
    args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--hostname", "sandbox"]
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    # Every writable place is bounded: /tmp and /dev/shm are sized tmpfs; the tmpfs under
    # "/" and the one holding /dev (no size of their own) are made read-only.
    size = [] if tmpfs_bytes is None else ["--size", str(tmpfs_bytes)]
    args += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", *size, "--tmpfs", "/tmp",
             "--bind", str(workdir), BWRAP_WORKDIR, "--chdir", BWRAP_WORKDIR]
    # After the working directory: a path under /work then lands on top of it.
    for shown in read_only_paths:
        args += ["--ro-bind", str(shown), str(shown)]
    return [*args, "--remount-ro", "/"]


#: What each mode protects, one line.
DESCRIPTIONS = {
    "bwrap": "bubblewrap: private network, private PID namespace, read-only system folders, "
             "only the run's working directory writable; plus rlimits",
    "unshare": "unshare: private network and PID namespace; host file system protected only "
               "by the sandbox user's permissions; plus rlimits",
    "rlimits": "rlimits only: resource limits, scrubbed environment, own session; NO network "
               "or file-system isolation",
}


#: What each mode does not protect, one line.
GAPS = {
    "bwrap": "the kernel (namespaces and rlimits, not a VM); /etc and the other system "
             "folders are readable as the sandbox user",
    "unshare": "the file system: the host's, guarded only by the sandbox user's "
               "permissions (world-readable files are readable, /tmp writable)",
    "rlimits": "network (the host's, including loopback services and metadata addresses) "
               "and file system; as a non-root server, commands run as the server's user "
               "and can read its files and /proc/<server>/environ",
}


def probe(mode: str, probe_dir: Path, uid: int | None, gid: int | None) -> str | None:
    """Why ``mode`` does not work here, or None when it does (by running ``true`` in it).

    Args:
        mode: "bwrap", "unshare" or "rlimits".
        probe_dir: A folder like the runs' working directories (the sandbox root).
        uid: The sandbox user, when the server is root.
        gid: The sandbox group.
    """
    if uid is not None:
        # Every mode hands the command paths in its working directory.
        blocked = untraversable(probe_dir, uid, gid if gid is not None else uid)
        if blocked is not None:
            return (f"sandbox_root {probe_dir} cannot be reached by the sandbox user "
                    f"(uid {uid}): {blocked}; make every parent folder searchable by others "
                    "(chmod o+x) or set sandbox_root elsewhere")
    if mode == "rlimits":
        return None
    if shutil.which(mode) is None:
        return f"{mode} is not installed (not on the server's PATH)"
    if mode == "unshare" and os.geteuid() != 0:
        return "unshare needs the server to run as root"
    argv = Isolation(mode, "").command(["true"], probe_dir, limits=[], uid=uid, gid=gid)
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=10,
                              cwd=probe_dir, env={"PATH": SANDBOX_PATH}, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{mode} could not be started: {exc}"
    if done.returncode == 0:
        return None
    said = done.stderr.decode(errors="replace").strip().splitlines()
    return f"{mode} failed here: {said[-1] if said else f'exit status {done.returncode}'}"


def untraversable(path: Path, uid: int, gid: int) -> str | None:
    """The first folder on the way to ``path`` that ``uid``/``gid`` may not search, as
    "FOLDER is mode 0700 owned by uid N", or None when the way is open (ACLs aside)."""
    current = Path("/")
    for part in path.resolve().parts[1:]:
        try:
            info = current.stat()
        except OSError as exc:
            return f"{current}: {exc.strerror}"
        if not has_permission(info, uid, gid, 0o1):
            return (f"{current} is mode {stat.S_IMODE(info.st_mode):04o} owned by uid "
                    f"{info.st_uid}")
        current = current / part
    return None


def has_permission(info: os.stat_result, uid: int, gid: int, bit: int) -> bool:
    """Whether ``uid`` (primary group ``gid`` only, as ``setpriv --clear-groups`` leaves
    it) holds the permission ``bit`` (4 read, 2 write, 1 search/execute) on ``info``."""
    if uid == 0:
        return True
    if info.st_uid == uid:
        return bool(info.st_mode & (bit << 6))
    if info.st_gid == gid:
        return bool(info.st_mode & (bit << 3))
    return bool(info.st_mode & bit)


#: PATH inside the sandbox.
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


@functools.cache
def detect(wanted: str, probe_dir: Path, uid: int | None, gid: int | None) -> Isolation:
    """The strongest mode that works (``wanted="auto"``) or the wanted one.

    Raises:
        RuntimeError: The wanted mode does not work on this machine.
    """
    for needed in ("prlimit", "setpriv"):
        if shutil.which(needed) is None:
            raise RuntimeError(f"the sandbox needs {needed} (util-linux)")
    candidates = MODES if wanted == "auto" else (wanted,)
    skipped: dict[str, str] = {}
    for mode in candidates:
        reason = probe(mode, probe_dir, uid, gid)
        if reason is None:
            return Isolation(mode, DESCRIPTIONS[mode], skipped)
        skipped[mode] = reason
    reasons = dict.fromkeys(skipped.values())  # one reason may stop every mode
    raise RuntimeError(f"sandbox isolation {wanted!r} does not work on this machine: "
                       + "; ".join(reasons))
