"""The peer for comparison runs: `python -m llama_cpp.server`, or llama.cpp's own `llama-server`
(bench/llama_server.py), started and stopped by the tool.

Owns: llama_cpp.server's command line, its readiness wait (`GET /v1/models`), its log file, and stopping
it; which of the two peers the flags ask for.
Must not: run workloads (compare.py does) or build llama-server (bench/llama_server.py does).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Protocol

from bench.llama_server import LlamaServer
from bench.processes import ServerProcess, free_port

LLAMA_CPP_SERVER = "llama_cpp.server"
LLAMA_SERVER = "llama-server"
# llama-server's slots when --peer-slots is not given: the worker's default --max-sessions, so both
# sides decode as many sequences at once.
DEFAULT_SLOTS = 16


class Peer(Protocol):
    """What comparison mode needs of a peer server."""

    name: str
    url: str
    log_path: Path

    def start(self) -> None: ...

    def stop(self) -> None: ...


class LlamaCppServer(ServerProcess):
    """`with LlamaCppServer(model, threads=2) as peer:` ... `peer.url` is its loopback base URL."""

    name = LLAMA_CPP_SERVER
    ready_path = "/v1/models"

    def __init__(self, model_path: Path, *, threads: int, port: int | None = None, n_ctx: int = 2048,
                 python: str = sys.executable, startup_timeout: float = 120.0) -> None:
        self.model_path = model_path
        self.threads = threads
        self.port = port or free_port()
        self.n_ctx = n_ctx
        self.python = python
        self.startup_timeout = startup_timeout
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.gettempdir()) / f"bench-load-llama-cpp-server-{self.port}.log"

    def argv(self) -> list[str]:
        t = str(self.threads)
        return [self.python, "-m", "llama_cpp.server", "--model", str(self.model_path),
                "--n_threads", t, "--n_threads_batch", t, "--n_ctx", str(self.n_ctx),
                "--host", "127.0.0.1", "--port", str(self.port),
                # By default a new request cuts the running stream short ("[DONE]" early), which would
                # count truncated answers as successes; off, requests wait their turn instead.
                "--interrupt_requests", "False", "--verbose", "False"]


def make_peer(kind: str, model_path: Path, *, threads: int, port: int | None, n_ctx: int,
              slots: int | None = None, cache: Path | None = None) -> Peer:
    """`kind` LLAMA_CPP_SERVER or LLAMA_SERVER; `n_ctx` is llama_cpp.server's whole context and each of
    llama-server's `slots` contexts (it gets n_ctx x slots); `cache`: llama-server's build cache root."""
    if kind == LLAMA_CPP_SERVER:
        return LlamaCppServer(model_path, threads=threads, port=port, n_ctx=n_ctx)
    if kind == LLAMA_SERVER:
        return LlamaServer(model_path, threads=threads, port=port, n_ctx=n_ctx, slots=slots or DEFAULT_SLOTS,
                           cache=cache)
    raise ValueError(f"unknown peer {kind!r}")
