"""Sampling profiles of a server process with py-spy, and a summary a person can read.

``py-spy record --format raw`` writes collapsed stacks ("outer;…;inner count"); this module
turns them into the functions that use the CPU, by self time (the frame on top of the stack)
and inclusive time (anywhere on the stack). Only samples where Python was running count
(py-spy leaves idle samples out by default), so the shares are shares of busy CPU time.
"""

from __future__ import annotations

import gzip
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME_LINE = re.compile(r":\d+\)$")
#: Frames on (nearly) every stack, which say nothing about where the time goes.
_PLUMBING = ("asyncio/", "click/", "<frozen runpy>", "threading.py", "selectors.py",
             "stargrpc/cli/", "bench/launch.py", "<module> (", "main (bench/")


def py_spy() -> str | None:
    """The py-spy executable, when installed (``pip install -r bench/requirements.txt``):
    beside this interpreter (a virtualenv not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Recorder:
    """``py-spy record`` attached to a running process until :meth:`stop`."""

    def __init__(self, pid: int, output: Path, rate: int = 250) -> None:
        executable = py_spy()
        if executable is None:
            raise RuntimeError("py-spy is not installed: pip install -r bench/requirements.txt")
        self.output = output
        self._process = subprocess.Popen(
            # --gil: only samples holding the GIL, i.e. Python actually running; an event
            # loop waiting in epoll, or a worker thread waiting on its queue, is not CPU.
            [executable, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate),
             "--nonblocking", "--gil", "--output", str(output)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self, timeout: float = 30.0) -> Path | None:
        """Stops sampling and writes the profile; None when py-spy failed."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        return self.output if self.output.exists() else None


@dataclass
class Summary:
    """Where the busy CPU time of a profile went."""

    samples: int
    self_share: list[tuple[str, float]]
    inclusive_share: list[tuple[str, float]]

    def render(self, top: int = 25) -> str:
        """The summary as text: the top functions by self and by inclusive share."""
        lines = [f"samples: {self.samples}", "", "self (top of stack):"]
        lines += [f"  {share:6.1%}  {name}" for name, share in self.self_share[:top]]
        lines += ["", "inclusive (anywhere on the stack):"]
        lines += [f"  {share:6.1%}  {name}" for name, share in self.inclusive_share[:top]]
        return "\n".join(lines) + "\n"


def _frame_name(frame: str) -> str:
    # "Run._emit (stargrpc/runs/run.py:330)" → "Run._emit (stargrpc/runs/run.py)": one row
    # per function.
    name = _FRAME_LINE.sub(")", frame.strip())
    return name.replace("/work/main/", "").split("site-packages/")[-1]


def compress(raw: Path) -> Path:
    """Gzips a raw profile in place (they run to megabytes); returns the ``.gz`` path."""
    packed = raw.with_name(raw.name + ".gz")
    packed.write_bytes(gzip.compress(raw.read_bytes()))
    raw.unlink()
    return packed


def summarize(raw: Path) -> Summary:
    """Aggregates a py-spy raw profile by function (inclusive shares leave out the event
    loop, runner and CLI frames that are on every stack)."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    samples = 0
    data = raw.read_bytes()
    text = (gzip.decompress(data) if raw.suffix == ".gz" else data).decode(errors="replace")
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if not match:
            continue
        count = int(match["count"])
        frames = [_frame_name(f) for f in match["stack"].split(";") if f]
        if not frames:
            continue
        samples += count
        self_counts[frames[-1]] += count
        for name in set(frames):
            if not any(part in name for part in _PLUMBING):
                inclusive[name] += count
    total = samples or 1
    return Summary(
        samples=samples,
        self_share=[(name, n / total) for name, n in self_counts.most_common()],
        inclusive_share=[(name, n / total) for name, n in inclusive.most_common()],
    )
