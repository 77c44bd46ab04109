"""Free loopback ports for the servers a benchmark or a test starts itself (Redis nodes,
PostgreSQL, stargrpc), chosen below the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The cluster bus of a node on port P listens on P + 10000.
_BUS_OFFSET = 10000
#: The lowest port a server a test starts itself is given.
_LOWEST_PORT = 10000


def ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (and ``bind(0)``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, *, bus: bool = False) -> list[int]:
    """``count`` free loopback ports (and, for cluster nodes, each port + 10000 free too: the
    cluster bus), held open together while chosen, so no two are the same.

    Chosen below the kernel's ephemeral range: a port is free for a moment between being
    chosen and the server binding it (and again between a kill and a restart on it), and
    any outgoing connection of the suite (thousands, from every worker) could take an
    ephemeral one meanwhile: a Redis Cluster node then never answered."""
    highest = ephemeral_low() - 1 - (_BUS_OFFSET if bus else 0)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            port = random.randint(_LOWEST_PORT, highest)
            if port in ports:
                continue
            probes = []
            try:
                for taken in (port, port + _BUS_OFFSET) if bus else (port,):
                    probe = socket.socket()
                    probes.append(probe)
                    probe.bind(("127.0.0.1", taken))
            except OSError:
                for probe in probes:
                    probe.close()
                continue
            held.extend(probes)
            ports.append(port)
    finally:
        for probe in held:
            probe.close()
    return ports
