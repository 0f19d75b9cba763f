"""A small network of "hosts" on this machine: one network namespace per host, joined by a bridge.

Owns: creating the namespaces, the bridge and the veth pairs; starting processes inside a host;
taking a host off the network and back (its switch port down/up); adding latency to a host's
outgoing traffic; letting a thread of the test process act as a host (`enter`); and removing every
namespace, link and process it made, leftovers of dead runs included.
Must not: touch the machine's own (root) namespace. The bridge lives in a namespace of its own and
every link is created inside one of ours, so nothing appears in the root namespace, even briefly.

Layout (the names carry the owner's pid and a random tag, so parallel runs never clash and a run
killed too hard to clean up is swept by the next one):

    <tag>-br:   br0, and one port p-<host> per host (the switch)
    <tag>-<host>: eth0 (the other end of p-<host>) with the host's address, and lo

Addresses are the caller's, from 198.18.0.0/15 (RFC 2544, reserved for benchmarking networks), so
no traffic can leave for a real network: there is no route out of the namespaces anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "mh"
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
NAME_PATTERN = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-")
ROOT = Path(__file__).resolve().parents[2]
_libc = ctypes.CDLL(None, use_errno=True)


def missing_requirements() -> str | None:
    """Why this machine cannot run the network, or None when it can."""
    if os.geteuid() != 0:
        return "multi-host tests need root (they create network namespaces, a bridge and veth pairs)"
    if shutil.which("ip") is None:
        return "multi-host tests need iproute2's `ip` (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here (`ip netns add` said: {made.stderr.strip()})"
    ip("netns", "del", probe, check=False)
    return None


def enter(namespace: str) -> None:
    """Moves the calling thread (only it) into `namespace`: sockets it opens from then on live there.
    Used as a thread pool's initializer, so the test process talks from a host on the bridge."""
    fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


@dataclass
class Host:
    name: str
    namespace: str
    address: str  # on eth0, /24
    port: str  # its port on the bridge, in the bridge's namespace


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Delay:
    """Latency added to one host's outgoing traffic; `method` says how (netem, or the delay line)."""
    host: Host
    seconds: float
    method: str


@dataclass
class Network:
    log_dir: Path
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}")
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.tag}-br"

    def create(self) -> None:
        sweep_leftovers()
        self._add_namespace(self.bridge)
        ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge, "link", "set", "br0", "up")

    def add_host(self, name: str, address: str) -> Host:
        host = Host(name, f"{self.tag}-{name}", address, f"p-{name}")
        self._add_namespace(host.namespace)
        # Made inside the bridge's namespace; the peer is created straight into the host's.
        ip("-n", self.bridge, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
           "netns", host.namespace)
        ip("-n", self.bridge, "link", "set", host.port, "master", "br0", "up")
        ip("-n", host.namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        self.hosts[name] = host
        return host

    def spawn(self, namespace: str, name: str, argv: Sequence[str], env: Mapping[str, str]) -> Proc:
        """Runs `argv` inside a namespace of ours, in its own process group, output to `<log_dir>/<name>.log`."""
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], cwd=ROOT, env=dict(env),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def partition(self, host: Host) -> None:
        """Unplugs the host: its switch port goes down, so nothing reaches it or leaves it."""
        ip("-n", self.bridge, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        ip("-n", self.bridge, "link", "set", host.port, "up")

    def isolate(self, host: Host) -> None:
        """Takes the host's own interface down: nothing reaches it or leaves it, with or without a delay
        line spliced in at its switch port (which `partition` would pull from under the line)."""
        ip("-n", host.namespace, "link", "set", "eth0", "down")

    def rejoin(self, host: Host) -> None:
        """Undoes `isolate`: the interface keeps its address while down, and its route comes back up."""
        ip("-n", host.namespace, "link", "set", "eth0", "up")

    @contextlib.contextmanager
    def delay(self, host: Host, seconds: float) -> Iterator[Delay]:
        """Holds every frame the host sends for `seconds` (one way, like netem on its eth0). Uses
        `tc netem` where the kernel has it, else a delay line spliced in at the switch port."""
        netem = ip("netns", "exec", host.namespace, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                   f"{seconds * 1000:g}ms", check=False)
        if netem.returncode == 0:
            try:
                yield Delay(host, seconds, "tc netem")
            finally:
                ip("netns", "exec", host.namespace, "tc", "qdisc", "del", "dev", "eth0", "root")
            return
        with self._delay_line(host, seconds):
            yield Delay(host, seconds, f"delay line (tc netem unavailable: {netem.stderr.strip()[:80]})")

    @contextlib.contextmanager
    def _delay_line(self, host: Host, seconds: float) -> Iterator[None]:
        # p-<host> leaves the bridge; a veth pair d-<host>a/b takes its place; tests.multihost.delayline
        # copies frames between p-<host> and d-<host>b, holding the host's outgoing ones.
        inner, outer = f"d-{host.name}a", f"d-{host.name}b"
        ip("-n", self.bridge, "link", "add", inner, "type", "veth", "peer", "name", outer)
        ip("-n", self.bridge, "link", "set", outer, "up")
        line = self.spawn(self.bridge, f"delayline-{host.name}",
                          [sys.executable, "-m", "tests.multihost.delayline", host.port, outer, str(seconds)],
                          os.environ)
        try:
            _wait_for_line(line, "ready", timeout=10)
            ip("-n", self.bridge, "link", "set", host.port, "nomaster")
            ip("-n", self.bridge, "link", "set", inner, "master", "br0", "up")
            yield
        finally:
            ip("-n", self.bridge, "link", "del", inner, check=False)  # takes its peer with it
            ip("-n", self.bridge, "link", "set", host.port, "master", "br0", "up", check=False)
            _stop(line.popen)

    def close(self) -> None:
        """Stops every process (its whole group; all told at once, so their drains overlap), then anything
        still inside our namespaces, then deletes the namespaces, which takes their links with them.
        Every step is tried, whatever an earlier one did: it runs in finalizers."""
        _stop(*(proc.popen for proc in self.procs))
        for namespace in reversed(self._namespaces):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _remove_namespace(namespace)
        self._namespaces.clear()

    def _add_namespace(self, namespace: str) -> None:
        self._namespaces.append(namespace)  # first, so a half-made one is removed too
        ip("netns", "add", namespace)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def sweep_leftovers() -> None:
    """Removes the namespaces (and what runs in them) of earlier runs whose test process is gone."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        match = NAME_PATTERN.match(entry.name)
        if match and not _pid_alive(int(match.group(1))):
            _remove_namespace(entry.name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespace(namespace: str) -> None:
    # `ip netns pids` looks at each process's main thread, so this test process, whose client threads
    # (not its main thread) sit in the client's namespace, is never listed; the check is a guard.
    def inside() -> list[int]:
        return [int(p) for p in ip("netns", "pids", namespace, check=False).stdout.split() if int(p) != os.getpid()]

    for pid in inside():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while inside() and time.monotonic() < deadline:
        time.sleep(0.05)
    ip("netns", "del", namespace, check=False)


def _stop(*popens: subprocess.Popen[bytes]) -> None:
    """SIGTERM to each process group at once, then to each, once its leader exited or 5 s after the
    SIGTERM, SIGKILL (whatever else the group still holds); each leader waited for 5 s more."""
    for popen in popens:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for popen in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            popen.wait(5.0)


def _wait_for_line(proc: Proc, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log_path.read_text(errors="replace"):
        if not proc.running:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}: {proc.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not say {text!r} within {timeout:g} s: {proc.log_tail()}")
        time.sleep(0.05)
