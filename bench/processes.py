"""Servers the benchmarks start: launch, wait until ready (with a deadline), always stop.

Owns: the one way a benchmark runs a peer process on loopback. Must not: know what the peer is.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from bench.worker_token import ENV as WORKER_TOKEN_ENV

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port nothing listens on now, below the kernel's range for outgoing connections where
    that leaves room: a port the kernel picks from that range can become some client connection's own
    end before the server binds it (with the tests on two processes, start.sh's coordinator lost its
    port that way). A random one of those thousands, so two picks made before either is bound (two
    processes, or two servers of one test) differ all but always."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(PORTS_FROM, low) if low - PORTS_FROM >= 1000 else _kernels_pick()
        if port_is_free(port):
            return port
    raise OSError("no free loopback port found in 200 tries")


PORTS_FROM = 10_000  # below: well-known and registered services' ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PORTS_FROM  # unknown: the kernel picks


def _kernels_pick() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Nothing listens on (or holds) this loopback port now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


API_KEYS_ENV = "API_KEYS"  # the coordinator's client keys (coordinator/settings.py)


def peer_env(worker_token: str | None, api_keys: str | None = None) -> dict[str, str]:
    """This process's environment for a peer it starts, with WORKER_TOKEN exactly `worker_token` and
    API_KEYS exactly `api_keys` (each unset for None): a token or keys exported in the shell must not
    decide whether the peers ask for them."""
    env = {k: v for k, v in os.environ.items() if k not in (WORKER_TOKEN_ENV, API_KEYS_ENV)}
    if worker_token:
        env[WORKER_TOKEN_ENV] = worker_token
    if api_keys:
        env[API_KEYS_ENV] = api_keys
    return env


def wait_ready(proc: subprocess.Popen[bytes], ready_url: str, name: str, *, timeout: float,
               detail: Callable[[], str] = lambda: "") -> None:
    """Returns once `ready_url` answers 200; raises if the process exits or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready {detail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(ready_url, timeout=2.0, trust_env=False).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} was not ready after {timeout:.0f} s {detail()}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


@contextlib.contextmanager
def serving(name: str, argv: list[str], ready_url: str, *, log_path: Path | None = None,
            env: Mapping[str, str] | None = None, timeout: float = 180.0,
            cwd: Path = ROOT) -> Iterator[subprocess.Popen[bytes]]:
    """Starts `argv` in `cwd` (the repository root; another checkout runs that checkout's code: `-m`
    imports from the working directory first), waits until `ready_url` answers 200, yields the process,
    and stops it however the block ends. Output goes to `log_path`, or nowhere."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log_path.open("wb")) if log_path is not None else subprocess.DEVNULL
        proc = subprocess.Popen(argv, cwd=cwd, env=dict(env) if env is not None else None, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        stack.callback(stop, proc)
        wait_ready(proc, ready_url, name, timeout=timeout, detail=lambda: f"(log: {log_path})" if log_path else "")
        yield proc


@dataclass(frozen=True)
class Pool:
    url: str  # the (first) coordinator
    worker_urls: tuple[str, ...]
    worker_token: str  # the workers answer /metrics, /worker/sessions and generate only with it
    urls: tuple[str, ...] = ()  # every coordinator, the first first
    coordinator_pids: tuple[int, ...] = ()  # in `urls`' order
    worker_pids: tuple[int, ...] = ()  # in `worker_urls`' order


@contextlib.contextmanager
def pool(log_dir: Path, *, workers: Sequence[Sequence[str]], coordinator: Sequence[str] = (),
         api_keys: str | None = None, name: str = "pool", timeout: float = 60.0, coordinators: int = 1) -> Iterator[Pool]:
    """Real coordinators (`coordinators` of them, each on its own port, the same flags) and real workers
    (`python -m worker`, one per entry of `workers`, which holds each one's extra flags, heartbeating to
    every coordinator) on loopback; yields once every worker has registered with every coordinator,
    stops them all after. The pool has a worker token of its own, as start.sh's does by default
    (`Pool.worker_token`). `api_keys`: the coordinators' client keys (their API_KEYS: `KEY` or `KEY
    TENANT` entries, comma-separated; in the environment, not the command line, so `ps` does not show
    them); None: no keys."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(coordinators)]
    token = secrets.token_urlsafe(24)
    env = peer_env(token)
    coordinator_pids: list[int] = []
    worker_pids: list[int] = []
    with contextlib.ExitStack() as stack:
        for c, url in enumerate(urls, start=1):
            label = "coordinator" if coordinators == 1 else f"coordinator-{c}"
            coordinator_pids.append(stack.enter_context(serving(
                label, [sys.executable, "-m", "coordinator", "--port", url.rsplit(":", 1)[1], "--heartbeat-interval",
                        "1", "--log-level", "warning", *coordinator],
                url + "/coordinator/health", log_path=log_dir / f"{name}-{label}.log", env=peer_env(token, api_keys))).pid)
        worker_urls = []
        for i, extra in enumerate(workers, start=1):
            wport = free_port()
            worker_urls.append(f"http://127.0.0.1:{wport}")
            worker_pids.append(stack.enter_context(serving(
                f"worker-{i}", [sys.executable, "-m", "worker", "--port", str(wport), "--worker-id", f"w{i}",
                                "--coordinator-url", ",".join(urls), "--heartbeat-interval", "0.5",
                                "--log-level", "warning", *extra],
                worker_urls[-1] + "/worker/health", log_path=log_dir / f"{name}-w{i}.log", env=env)).pid)
        deadline = time.monotonic() + timeout
        for url in urls:
            while httpx.get(url + "/coordinator/health", timeout=2).json()["workers"]["alive"] < len(workers):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the workers did not register within {timeout:g} s (logs in {log_dir})")
                time.sleep(0.2)
        yield Pool(urls[0], tuple(worker_urls), token, tuple(urls), tuple(coordinator_pids), tuple(worker_pids))


def code_version(paths: Sequence[str] = ("worker", "protocol", "coordinator", "bench")) -> dict[str, Any]:
    """The commit measured, and any uncommitted change under `paths` (others may edit this tree). In a
    copy of the tree without git (the GPU machine), the commit named by BENCH_COMMIT, if any."""

    def git(*argv: str) -> str:
        try:
            done = subprocess.run(["git", *argv], check=False, cwd=ROOT, capture_output=True, text=True)
        except OSError:
            return os.environ.get("BENCH_COMMIT", "unknown") if argv[0] == "rev-parse" else ""
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--untracked-files=no", "--", *paths).splitlines()}


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ServerProcess:
    """A peer server for comparisons: started from `argv()` with its output in `log_path`, ready once
    `url + ready_path` answers 200, stopped however a `with` block ends (Ctrl+C while it loads too).
    Subclasses set `name`, `url`, `log_path`, `startup_timeout` and `ready_path` and give `argv()`."""

    name: str
    url: str
    log_path: Path
    startup_timeout: float
    ready_path: str
    _proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        """The server's environment; None: this process's."""
        return None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True)
        try:
            wait_ready(self._proc, self.url + self.ready_path, self.name, timeout=self.startup_timeout,
                       detail=lambda: ":\n" + self.log_tail())
        except BaseException:  # Ctrl+C while it loads included: never leave it running
            self.stop()
            raise

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop(proc)

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
