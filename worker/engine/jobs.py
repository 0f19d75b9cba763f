"""The engine's contract with the rest of the worker, the same for every engine backend (the llama.cpp
engine and the simulated one): its configuration, an admitted request (`Job`, with its further
choices when it asks for several), what a request's channel carries (`StreamItem`: the prompt's scores
when it asked for them, text pieces of any of its choices, then one `Finished` or `Failed`), and the
observer hooks.

Owns: these types only. Imports no llama.cpp, so the simulated backend and the HTTP side use them
without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.worker import GenerateRequest
from worker.engine.channel import TokenChannel
from worker.engine.sampling import Constraint
from worker.engine.textstream import Piece
from worker.sessions.messages import Message
from worker.sessions.table import Session


@dataclass(frozen=True)
class EngineConfig:
    ctx_size: int
    max_sessions: int
    threads: int
    prefill_chunk: int = 256
    prefill_stall: float = 0.0  # worker/engine/pacing.py; 0: every step may take a chunk
    kv_unified: bool = False
    flash_attn: int = -1  # llama.cpp's flash_attn_type: -1 auto, 0 off, 1 on
    slow_consumer_deadline: float = 10.0
    request_timeout: float = 600.0
    prompt_cache: bool = True  # split KV only: freed sequences keep their cells' tokens
    # Split KV, prompt cache on: a new request copies the cells of another sequence (running, kept or
    # freed) that holds at least this many more of its prompt's leading tokens than its own cells do.
    # llama.cpp copies a sequence's whole buffer across streams (session_max_tokens cells), so a
    # very short gain is left to prefill (docs/benchmarks.md, the 40-user runs by this minimum).
    prefix_min_tokens: int = 8
    # Split KV, prompt cache on: bytes of host memory that keep an interactive request's leftover cells
    # once another request takes their sequence (worker/sessions/host_cache.py); 0: none.
    host_cache_bytes: int = 0
    # A step carrying batch requests' rows is cut short when an interactive request comes while it runs
    # (llama.cpp's CPU backend; worker/backends/llama_interrupt.py).
    cut_batch_steps: bool = True
    # Beside interactive requests decoding, batch rows join a step only as far as the interactive rows'
    # steps stay within this factor of their time alone (worker/engine/batch_share.py); 0: every step.
    batch_slowdown: float = 0.0
    # Seconds between two wakes of the event loop for the tokens of running streams, at most (the
    # llama.cpp engine's `_wake`): a step shorter than this hands its tokens over with the next one's,
    # so each stream writes several tokens at once. First tokens and endings go at once.
    wake_interval: float = 0.04


@dataclass(frozen=True)
class Finished:
    """How a sequence ended; for a request of several choices, also how the whole request did: its
    `completion_tokens` sum every choice's, its times span them all, and `choices` holds each one's
    own ending, in choice order (empty for one choice)."""

    reason: str  # stop | length | cancelled
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_s: float
    prefill_s: float
    ttft_s: float
    total_s: float
    choices: tuple[Finished, ...] = ()


@dataclass(frozen=True)
class Failed:
    reason: str
    message: str


@dataclass(frozen=True)
class PromptScored:
    """A scored prompt (`prompt_logprobs`), its channel's first item: each token's text, its
    log-probability given those before it (None for the first) and the most likely tokens there."""

    tokens: list[str]
    logprobs: list[float | None]
    top: list[list[tuple[str, float]]]


StreamItem = Piece | PromptScored | Finished | Failed


@dataclass(frozen=True, eq=False)
class ExtraChoice:
    """Choice `index` (1 and up) of a request with several: its own sequence, which the engine fills with
    a copy of choice 0's cells once choice 0 has prefilled the prompt, and its own grammar state."""

    index: int
    session: Session
    constraint: Constraint | None = None


@dataclass(eq=False)
class Job:
    """An admitted request, built at the edge and handed to the engine thread. `session` and
    `constraint` are choice 0's; `extra_choices` the others' when the request asks for `n` > 1."""

    request_id: str
    request: GenerateRequest
    session: Session
    # What the sequence must hold before the first token generated here: the prompt, then, for a continuation,
    # the tokens an earlier worker generated (the last `continued` of them).
    prompt_tokens: list[int]
    cached_tokens: int  # leading prompt tokens already in the session's KV
    history: list[Message]  # the conversation including this turn's prompt (chat mode)
    channel: TokenChannel[StreamItem]
    admitted_at: float
    copied_tokens: int = 0  # of `cached_tokens`, those copied from another sequence's cells
    constraint: Constraint | None = None  # the request's grammar, compiled at admission
    extra_choices: tuple[ExtraChoice, ...] = ()
    # A continuation (GenerateRequest.generated): how many of `prompt_tokens` an earlier worker generated,
    # and their text. They count as completion tokens: the first generated here has index `continued`.
    continued: int = 0
    continued_text: str = ""
    # Engine side, n > 1: the choices that have ended so far (the request ends when all have).
    ended: dict[int, Finished] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        """The prompt's tokens, without those an earlier worker generated."""
        return len(self.prompt_tokens) - self.continued

    @property
    def n(self) -> int:
        return 1 + len(self.extra_choices)

    @property
    def sessions(self) -> tuple[Session, ...]:
        """Every sequence the request holds, choice 0's first."""
        return (self.session, *(extra.session for extra in self.extra_choices))


class EngineObserver:
    """Hooks the metrics module (and the tenants' ledger) implement; the default does nothing."""

    def step(self, sequences: int, prefill_tokens: int, seconds: float, decoding: int = 0) -> None: ...
    def token_gap(self, seconds: float) -> None: ...
    def decode_cpu(self, seconds: float) -> None: ...  # the engine thread's CPU inside one llama_decode

    def token_gaps(self, gaps: list[float]) -> None:
        """A step's gaps between tokens at once (`token_gap` each, unless an observer does better)."""
        for seconds in gaps:
            self.token_gap(seconds)

    def finished(self, job: Job, item: Finished | Failed) -> None: ...
    def internal_error(self, task: str) -> None: ...
    def parked(self, cell_bytes: int) -> None: ...
    def spilled(self, cell_bytes: int) -> None: ...  # leftover cells saved to host memory
    def step_cut(self, seconds: float) -> None: ...  # a step cut short for an interactive request, its time thrown away
    def step_spent(self, rows: str, seconds: float) -> None: ...  # a decoded step's time: "interactive", "batch", "both"
    def restored(self, tokens: int) -> None: ...  # a prompt's leading cells written back from host memory
    def resumed(self, paused_s: float) -> None: ...


class Observers(EngineObserver):
    """Several observers as one: each hook reaches each of them, in order."""

    def __init__(self, *observers: EngineObserver) -> None:
        self._observers = observers

    def step(self, sequences: int, prefill_tokens: int, seconds: float, decoding: int = 0) -> None:
        for observer in self._observers:
            observer.step(sequences, prefill_tokens, seconds, decoding)

    def token_gap(self, seconds: float) -> None:
        for observer in self._observers:
            observer.token_gap(seconds)

    def decode_cpu(self, seconds: float) -> None:
        for observer in self._observers:
            observer.decode_cpu(seconds)

    def token_gaps(self, gaps: list[float]) -> None:
        for observer in self._observers:
            observer.token_gaps(gaps)

    def finished(self, job: Job, item: Finished | Failed) -> None:
        for observer in self._observers:
            observer.finished(job, item)

    def internal_error(self, task: str) -> None:
        for observer in self._observers:
            observer.internal_error(task)

    def parked(self, cell_bytes: int) -> None:
        for observer in self._observers:
            observer.parked(cell_bytes)

    def resumed(self, paused_s: float) -> None:
        for observer in self._observers:
            observer.resumed(paused_s)

    def spilled(self, cell_bytes: int) -> None:
        for observer in self._observers:
            observer.spilled(cell_bytes)

    def restored(self, tokens: int) -> None:
        for observer in self._observers:
            observer.restored(tokens)

    def step_cut(self, seconds: float) -> None:
        for observer in self._observers:
            observer.step_cut(seconds)

    def step_spent(self, rows: str, seconds: float) -> None:
        for observer in self._observers:
            observer.step_spent(rows, seconds)


