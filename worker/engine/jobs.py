"""The engine's contract with the rest of the worker, the same for every engine backend (the llama.cpp
engine and the simulated one): its configuration, an admitted request (`Job`), what a request's
channel carries (`StreamItem`: text pieces, then `Finished` or `Failed`), and the observer hooks.

Owns: these types only. Imports no llama.cpp, so the simulated backend and the HTTP side use them
without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.worker import GenerateRequest
from worker.backends.base import Message
from worker.engine.channel import TokenChannel
from worker.engine.sampling import Constraint
from worker.engine.textstream import Piece
from worker.sessions.table import Session


@dataclass(frozen=True)
class EngineConfig:
    ctx_size: int
    max_sessions: int
    threads: int
    prefill_chunk: int = 256
    kv_unified: bool = False
    slow_consumer_deadline: float = 10.0
    request_timeout: float = 600.0
    prompt_cache: bool = True  # split KV only: freed sequences keep their cells' tokens
    # Split KV, prompt cache on: a new request copies the cells of another sequence (running, kept or
    # freed) that holds at least this many more of its prompt's leading tokens than its own cells do.
    # llama.cpp copies a sequence's whole buffer across streams (session_max_tokens cells), so a
    # very short gain is left to prefill (docs/benchmarks.md, the 40-user runs by this minimum).
    prefix_min_tokens: int = 8


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | cancelled
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_s: float
    prefill_s: float
    ttft_s: float
    total_s: float


@dataclass(frozen=True)
class Failed:
    reason: str
    message: str


StreamItem = Piece | Finished | Failed


@dataclass(eq=False)
class Job:
    """An admitted request, built at the edge and handed to the engine thread."""

    request_id: str
    request: GenerateRequest
    session: Session
    prompt_tokens: list[int]  # what the sequence must hold before the first generated token
    cached_tokens: int  # leading prompt tokens already in the session's KV
    history: list[Message]  # the conversation including this turn's prompt (chat mode)
    channel: TokenChannel[StreamItem]
    admitted_at: float
    copied_tokens: int = 0  # of `cached_tokens`, those copied from another sequence's cells
    constraint: Constraint | None = None  # the request's grammar, compiled at admission


class EngineObserver:
    """Hooks the metrics module implements; the default does nothing."""

    def step(self, sequences: int, prefill_tokens: int, seconds: float) -> None: ...
    def token_gap(self, seconds: float) -> None: ...
    def finished(self, job: Job, item: Finished | Failed) -> None: ...
    def internal_error(self, task: str) -> None: ...


