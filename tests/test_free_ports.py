"""The ports the suite starts its own servers on (redis-server nodes, PostgreSQL,
``stargrpc serve``): below the kernel's ephemeral range, so that none of the suite's own
outgoing connections can take one between its choice and the server binding it."""

from __future__ import annotations

import socket

from bench.ports import ephemeral_low, free_ports
from tests.helpers import free_port


def test_ports_for_servers_are_chosen_below_the_ephemeral_range_and_free() -> None:
    nodes = free_ports(6, bus=True)
    single = free_port()

    assert len(set(nodes)) == 6
    assert all(port + 10000 < ephemeral_low() for port in nodes)  # the cluster bus too
    assert single < ephemeral_low()
    for port in (*nodes, *(port + 10000 for port in nodes), single):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free once chosen
