"""bench/processes.py's port picking: below the kernel's range for outgoing connections, and free."""

from __future__ import annotations

import socket
from pathlib import Path

from bench.processes import PORTS_FROM, free_port, port_is_free


def test_a_free_port_is_free_and_below_the_range_outgoing_connections_take_their_ends_from() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(PORTS_FROM <= port < low for port in ports), (low, ports)
    assert len(set(ports)) > 10  # picked at random, not one after another
    assert all(port_is_free(port) for port in ports)


def test_a_port_something_listens_on_is_not_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])
