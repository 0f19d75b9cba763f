"""A delay line between two network interfaces, for kernels built without `netem`.

Owns: copying Ethernet frames both ways between two interfaces of one network namespace, holding
the frames that leave interface A for a fixed delay (like `tc qdisc add dev A root netem delay D`
on the host behind A), and passing the other direction at once.
Must not: touch any interface but the two it is given, or parse what the frames carry.

Run as `ip netns exec NS python -m tests.multihost.delayline A B SECONDS`; it prints `ready` once both
sockets are bound and runs until SIGTERM. It uses packet sockets with virtio-net headers
(`PACKET_VNET_HDR`), so a TCP segment the sending kernel left for offload (a 64 KiB GSO frame, or a
checksum still to fill in) is handed on with that state intact instead of being dropped as too large
or corrupt. The delay queue is bounded (`MAX_HELD` frames); past it frames are dropped, as a full
qdisc would drop them.
"""

from __future__ import annotations

import collections
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
FRAME_BYTES = 65_536 + 64  # a GSO frame and its virtio-net header
MAX_HELD = 4_096


def _socket(interface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: nothing until bound
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # not the frames we send ourselves
    sock.bind((interface, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def run(a: str, b: str, delay: float) -> None:
    side_a, side_b = _socket(a), _socket(b)
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while not stopping:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([side_a, side_b], [], [], wait)
        except InterruptedError:
            continue
        if side_a in readable:
            for frame in _drain(side_a):
                if len(held) < MAX_HELD:
                    held.append((time.monotonic() + delay, frame))
        if side_b in readable:
            for frame in _drain(side_b):
                _send(side_a, frame)
        now = time.monotonic()
        while held and held[0][0] <= now:
            _send(side_b, held.popleft()[1])


def _drain(sock: socket.socket) -> list[bytes]:
    frames: list[bytes] = []
    while len(frames) < 256:
        try:
            frames.append(sock.recv(FRAME_BYTES))
        except BlockingIOError:
            break
    return frames


def _send(sock: socket.socket, frame: bytes) -> None:
    try:
        sock.send(frame)
    except OSError:
        pass  # a full or downed link drops the frame, as a wire would; TCP resends it


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], float(sys.argv[3]))
