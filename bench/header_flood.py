"""Header lines that never end, against a real coordinator: what its edge (serving/edge.py) buffers.

Starts a coordinator on a free loopback port, opens `--connections` connections that each send a
request line and one header line of up to `--megabytes` MB with no line end, probes
`/coordinator/health` meanwhile, and prints the coordinator's RSS before and at its peak, the
slowest health answer, and how much each connection could send before its answer.

    .venv/bin/python -m bench.header_flood [--connections 8] [--megabytes 200]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

import httpx

from bench.processes import free_port

CHUNK = b"a" * (1 << 20)


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) // 1024


def flood(port: int, megabytes: int, results: list[tuple[int, bytes]]) -> None:
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ")
            while sent < megabytes << 20:
                sock.sendall(CHUNK)
                sent += len(CHUNK)
        except OSError:
            pass  # refused while sending: the answer is in the receive buffer
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
    results.append((sent, answer.split(b"\r\n", 1)[0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--megabytes", type=int, default=200)
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}/coordinator/health"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "--port", str(port), "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        before = peak = rss_mb(proc.pid)
        results: list[tuple[int, bytes]] = []
        threads = [threading.Thread(target=flood, args=(port, args.megabytes, results)) for _ in range(args.connections)]
        for thread in threads:
            thread.start()
        slowest, probes = 0.0, 0
        while any(thread.is_alive() for thread in threads):
            started = time.monotonic()
            httpx.get(url, timeout=10)
            slowest, probes = max(slowest, time.monotonic() - started), probes + 1
            peak = max(peak, rss_mb(proc.pid))
            time.sleep(0.02)
        print(f"coordinator RSS {before} MB before, {peak} MB at its peak; slowest health answer "
              f"{slowest * 1000:.1f} ms over {probes} probes")
        for sent, answer in sorted(results):
            print(f"  sent {sent / (1 << 20):.0f} MB of a {args.megabytes} MB header line, then: {answer.decode()}")
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
