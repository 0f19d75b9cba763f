"""The harness itself, without the model: two hosts on the bridge, an echo server on one, round trips
from the other; the delay and the partition do what they claim; a failing test leaves nothing behind."""

from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.multihost.netns import NETNS_DIR, Network, enter, missing_requirements

ECHO = """
import socket, threading
server = socket.create_server(("198.18.1.2", 7000))
print("ready", flush=True)
def echo(conn):
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""


def round_trips(count: int = 5) -> list[float]:
    """Seconds per 1-byte echo over one connection; raises if the server cannot be reached in 1 s."""
    with socket.create_connection(("198.18.1.2", 7000), timeout=1.0) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(count):
            start = time.monotonic()
            conn.sendall(b"x")
            assert conn.recv(1) == b"x"
            times.append(time.monotonic() - start)
    return times


def test_hosts_talk_over_the_bridge_delay_and_partition_work_and_nothing_is_left(tmp_path: Path) -> None:
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    network = Network(tmp_path)
    made: list[str] = []
    with pytest.raises(RuntimeError, match="a test failing here"):
        try:
            network.create()
            network.add_host("a", "198.18.1.1")
            b = network.add_host("b", "198.18.1.2")
            made = sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(network.tag))
            server = network.spawn(b.namespace, "echo", [sys.executable, "-c", ECHO], dict(os.environ))
            with ThreadPoolExecutor(1, initializer=enter, initargs=(network.hosts["a"].namespace,)) as host_a:
                deadline = time.monotonic() + 10
                while "ready" not in server.log_path.read_text():
                    assert server.running and time.monotonic() < deadline, server.log_tail()
                    time.sleep(0.05)
                plain = min(host_a.submit(round_trips).result())
                with network.delay(b, 0.05) as delay:
                    delayed = min(host_a.submit(round_trips).result())
                network.partition(b)
                with pytest.raises(OSError):  # a timeout: nothing comes back from b
                    host_a.submit(round_trips).result()
                network.heal(b)
                healed = min(host_a.submit(round_trips).result())
            assert plain < 0.02 and healed < 0.02, (plain, healed)
            assert 0.05 <= delayed < 0.09, (delayed, delay.method)
            raise RuntimeError("a test failing here")
        finally:
            network.close()
    assert made == sorted(f"{network.tag}-{n}" for n in ("a", "b", "br"))
    assert not [p.name for p in NETNS_DIR.iterdir() if p.name.startswith(network.tag)]
    assert not server.running
