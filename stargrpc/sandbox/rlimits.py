"""Resource limits of a sandboxed run, and how a run that hit one is recognised.

The limits are rlimits set by ``prlimit`` just before the command (or its isolation
wrapper) is executed, so they apply to every process of the run. How a limit shows itself
differs per limit, so :func:`classify` looks at the signal, the CPU time used, the files
left behind and the tail of stderr, most specific first.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from stargrpc.settings import MiB, Settings


@dataclass(frozen=True)
class Limits:
    """The limits of one run.

    Attributes:
        cpu_seconds: CPU time per process (SIGXCPU at the limit, SIGKILL a second later).
        memory_bytes: Address space per process.
        file_size_bytes: Largest file a process may write.
        max_processes: Processes (and threads) the sandbox user may have.
        max_open_files: Open file descriptors per process.
        wall_clock_seconds: Real time before the whole run is killed.
        output_bytes: stdout+stderr streamed before the output is cut.
        sent_file_bytes: Total size of output-folder files returned.
        disk_bytes: Disk space of the working directory (and the size of each private
            tmpfs in bubblewrap).
    """

    cpu_seconds: int = 10
    memory_bytes: int = 512 * MiB
    file_size_bytes: int = 64 * MiB
    max_processes: int = 64
    max_open_files: int = 256
    wall_clock_seconds: float = 60.0
    output_bytes: int = 1 * MiB
    sent_file_bytes: int = 8 * MiB
    disk_bytes: int = 256 * MiB

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        """The limits the server is configured with."""
        return cls(
            cpu_seconds=settings.sandbox_cpu_seconds,
            memory_bytes=settings.sandbox_memory_mb * MiB,
            file_size_bytes=settings.sandbox_file_size_mb * MiB,
            max_processes=settings.sandbox_max_processes,
            max_open_files=settings.sandbox_max_open_files,
            wall_clock_seconds=settings.sandbox_wall_clock_seconds,
            output_bytes=settings.sandbox_output_bytes,
            sent_file_bytes=settings.sandbox_sent_file_bytes,
            disk_bytes=settings.sandbox_disk_mb * MiB,
        )

    def prlimit_argv(self) -> list[str]:
        """The ``prlimit`` prefix that applies these limits (soft:hard)."""
        return [
            "prlimit",
            # A soft CPU limit one second under the hard one: the process gets SIGXCPU
            # (recognisable) before the kernel's SIGKILL.
            f"--cpu={self.cpu_seconds}:{self.cpu_seconds + 1}",
            f"--as={self.memory_bytes}",
            f"--fsize={self.file_size_bytes}",
            f"--nproc={self.max_processes}",
            f"--nofile={self.max_open_files}",
            "--core=0",
            "--",
        ]


@dataclass(frozen=True)
class Verdict:
    """Why a run ended the way it did.

    Attributes:
        code: Stable code: OK, EXIT_STATUS, CPU_LIMIT, MEMORY_LIMIT, FILE_SIZE_LIMIT,
            PROCESS_LIMIT, OPEN_FILES_LIMIT, WALL_CLOCK_LIMIT, DISK_LIMIT, SIGNAL.
        message: A specific, user-safe reason.
    """

    code: str
    message: str

    @property
    def ok(self) -> bool:
        """Whether the command succeeded."""
        return self.code == "OK"


_MEMORY = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory",
                     re.IGNORECASE)
_PROCESSES = re.compile(r"(BlockingIOError|fork|thread).{0,80}Resource temporarily unavailable"
                        r"|Resource temporarily unavailable.{0,40}fork|can't start new thread",
                        re.IGNORECASE | re.DOTALL)
_FILE_SIZE = re.compile(r"File too large|File size limit exceeded", re.IGNORECASE)
_OPEN_FILES = re.compile(r"Too many open files", re.IGNORECASE)
#: A full private tmpfs (bubblewrap) says so with ENOSPC.
_DISK = re.compile(r"No space left on device|Disk quota exceeded", re.IGNORECASE)


def _mb(value: int) -> str:
    return f"{value / MiB:g} MB"


def disk_limit(limits: Limits) -> Verdict:
    """The verdict on a run that used more disk than allowed."""
    return Verdict("DISK_LIMIT", f"stopped: disk limit of {_mb(limits.disk_bytes)} exceeded")


def classify(limits: Limits, *, exit_signal: int | None, exit_status: int | None,
             cpu_seconds: float, largest_file: int, stderr_tail: str,
             disk_used: int = 0) -> Verdict:
    """The verdict on a run that ended by itself (not killed by the runner).

    Args:
        limits: The limits it ran with.
        exit_signal: The signal that ended it, if any.
        exit_status: Its exit status, if it exited.
        cpu_seconds: CPU time used by it and its reaped descendants.
        largest_file: Size of the largest file left in its working directory.
        stderr_tail: The end of what it wrote to stderr.
        disk_used: Disk space its working directory holds at the end.
    """
    if disk_used > limits.disk_bytes:
        return disk_limit(limits)
    if exit_status == 0:
        return Verdict("OK", "exited with status 0")
    if exit_signal == signal.SIGXCPU or cpu_seconds >= limits.cpu_seconds:
        return Verdict("CPU_LIMIT",
                       f"killed: CPU time limit of {limits.cpu_seconds} s exceeded")
    if exit_signal == signal.SIGXFSZ or _FILE_SIZE.search(stderr_tail) or (
            largest_file >= limits.file_size_bytes):
        return Verdict("FILE_SIZE_LIMIT",
                       f"stopped: file size limit of {_mb(limits.file_size_bytes)} exceeded")
    if _DISK.search(stderr_tail):
        return disk_limit(limits)
    if _MEMORY.search(stderr_tail):
        return Verdict("MEMORY_LIMIT",
                       f"stopped: memory limit of {_mb(limits.memory_bytes)} exceeded")
    if _PROCESSES.search(stderr_tail):
        return Verdict("PROCESS_LIMIT",
                       f"stopped: process limit of {limits.max_processes} reached "
                       "(fork bomb?)")
    if _OPEN_FILES.search(stderr_tail):
        return Verdict("OPEN_FILES_LIMIT",
                       f"stopped: open files limit of {limits.max_open_files} reached")
    if exit_signal is not None:
        try:
            name = signal.Signals(exit_signal).name
        except ValueError:
            name = str(exit_signal)
        return Verdict("SIGNAL", f"killed by signal {name}")
    return Verdict("EXIT_STATUS", f"exited with status {exit_status}")
