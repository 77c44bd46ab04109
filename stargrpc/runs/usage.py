"""A run's receipt: :class:`RunUsage`, what a run used, as ``Result.usage`` reports it.

The run measures its own wall time; everything else is reported by whoever can measure it
honestly, through ``ctx.usage``: the sandbox reports the process tree of each command it
ran (:meth:`RunUsage.add_processes`), ``http_fetch`` and the MCP upstream tools the bytes
they exchanged (:meth:`RunUsage.add_network`). What nobody reported stays unset in the
Result — "not measured", never a made-up zero. In particular nothing reports the CPU time
or memory of an in-process tool: it shares the server's process and event loop with every
other run, and no per-run figure of either would be true.
"""

from __future__ import annotations

import threading

from stargrpc.v1 import events_pb2


class RunUsage:
    """What one run used beyond its wall time, as tools report it (``ctx.usage``).

    Each figure is None until something reports it. Safe to call from a plain ``def``
    tool's thread.

    Attributes:
        cpu_user_seconds: User-mode CPU seconds of the process trees the run ran.
        cpu_system_seconds: Kernel-mode CPU seconds of those trees.
        peak_rss_bytes: The largest peak resident memory of a single process among them.
        bytes_written: Bytes of storage the files they left take.
        network_bytes_sent: Bytes sent over the network through stargrpc.
        network_bytes_received: Bytes received over the network through stargrpc.
    """

    cpu_user_seconds: float | None
    cpu_system_seconds: float | None
    peak_rss_bytes: int | None
    bytes_written: int | None
    network_bytes_sent: int | None
    network_bytes_received: int | None
    _lock: threading.Lock

    def __init__(self) -> None:
        self.cpu_user_seconds = None
        self.cpu_system_seconds = None
        self.peak_rss_bytes = None
        self.bytes_written = None
        self.network_bytes_sent = None
        self.network_bytes_received = None
        self._lock = threading.Lock()

    def add_network(self, *, sent: int = 0, received: int = 0) -> None:
        """Counts bytes the run exchanged over the network on the caller's behalf.

        Call it for traffic the tool itself makes (an HTTP request, a message to a server
        behind stargrpc), with the bytes of the messages as they went and came (before
        decompression), transport framing aside. Calling it at all marks the run's
        network figures as measured: a tool that made no request may call it with zeros.

        Args:
            sent: Bytes sent.
            received: Bytes received.

        Raises:
            ValueError: A count is negative.
        """
        if sent < 0 or received < 0:
            raise ValueError("byte counts cannot be negative")
        with self._lock:
            self.network_bytes_sent = (self.network_bytes_sent or 0) + sent
            self.network_bytes_received = (self.network_bytes_received or 0) + received

    def add_processes(self, *, cpu_user_seconds: float | None = None,
                      cpu_system_seconds: float | None = None,
                      peak_rss_bytes: int | None = None,
                      bytes_written: int | None = None) -> None:
        """Counts a process tree the run ran (the sandbox calls it for each command).

        CPU time and bytes written add up over the trees of one run; the peak is the
        largest of theirs. A figure left None was not measured and stays as it was.

        Args:
            cpu_user_seconds: User-mode CPU seconds of the tree.
            cpu_system_seconds: Kernel-mode CPU seconds of the tree.
            peak_rss_bytes: The peak resident memory of its largest process, in bytes.
            bytes_written: Bytes of storage the files it left take.
        """
        with self._lock:
            if cpu_user_seconds is not None:
                self.cpu_user_seconds = ((self.cpu_user_seconds or 0.0)
                                         + max(cpu_user_seconds, 0.0))
            if cpu_system_seconds is not None:
                self.cpu_system_seconds = ((self.cpu_system_seconds or 0.0)
                                           + max(cpu_system_seconds, 0.0))
            if peak_rss_bytes is not None:
                self.peak_rss_bytes = max(self.peak_rss_bytes or 0, peak_rss_bytes, 0)
            if bytes_written is not None:
                self.bytes_written = (self.bytes_written or 0) + max(bytes_written, 0)

    def fill(self, message: events_pb2.Usage) -> None:
        """Sets the fields of ``message`` that were reported (the others stay unset)."""
        with self._lock:
            if self.cpu_user_seconds is not None:
                message.cpu_user_seconds = self.cpu_user_seconds
            if self.cpu_system_seconds is not None:
                message.cpu_system_seconds = self.cpu_system_seconds
            if self.peak_rss_bytes is not None:
                message.peak_rss_bytes = self.peak_rss_bytes
            if self.bytes_written is not None:
                message.bytes_written = self.bytes_written
            if self.network_bytes_sent is not None:
                message.network_bytes_sent = self.network_bytes_sent
            if self.network_bytes_received is not None:
                message.network_bytes_received = self.network_bytes_received


def fill_usage(message: events_pb2.Usage, duration_ns: int, reported: RunUsage | None, *,
               queued_ns: int = 0, child_runs: int = 0) -> None:
    """Fills a Result's ``usage``: what every run measures (its wall time after its START,
    the time it waited before it — approval, a lane's queue —, the runs its tool started)
    and what was reported for it."""
    message.wall_seconds = duration_ns / 1e9
    message.queued_seconds = queued_ns / 1e9
    message.child_runs = child_runs
    if reported is not None:
        reported.fill(message)


def usage_dict(message: events_pb2.Usage) -> dict[str, float | int]:
    """The fields of ``message`` that are set, by name, as plain numbers (JSON-ready: no
    64-bit integers as strings, unlike the protobuf JSON mapping)."""
    return {field.name: value for field, value in message.ListFields()}


def usage_json(result: events_pb2.Result | None) -> str:
    """The usage of ``result`` as compact JSON, fields in the contract's order; "" when
    the Result has none (as from a server before receipts)."""
    if result is None or not result.HasField("usage"):
        return ""
    # Every field is a number (a finite float or an int), whose repr is its JSON: written
    # directly, as json.dumps builds an encoder per call, on every run's audit record.
    return "{" + ",".join(f'"{field.name}":{value!r}'
                          for field, value in result.usage.ListFields()) + "}"
