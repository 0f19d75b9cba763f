"""SIMULATED engine and model: tokens at a configured rate, no model, for measuring the coordinator.

Never the default: a worker runs this only with `--engine simulated` (or `python -m worker.simulate`).
It stands behind the same API as the real engine and uses the same session table, admission, KV
accounting (bytes per token as configured) and bounded channels, so the coordinator sees exactly what
a real worker would show: the same events, the same 503/409/413 refusals, the same heartbeats.
It runs on the event loop (no thread), so many simulated workers can share one process.

Owns: a stand-in tokenizer (one token per 4 UTF-8 bytes), the pacing of tokens and prefill, the
choices of a request with `n` > 1 (each a sequence of its own that starts once the prompt's
simulated prefill is done, holding the prompt's tokens as the real engine's copy would; choice i
starts its words i words further on, so choices differ), a continuation (`GenerateRequest.generated`:
those tokens prefilled after the prompt, counted, and the words going on at their position, as the
real engine's), and stand-in embeddings (the mean of a
fixed random vector per token id, normalised). How a
sequence ends (cancel, queued or running; deadline; slow consumer; stop strings; max_tokens; the KV
reservation) is the real engine's own rules (worker/engine/endings.py), not a copy.
Must not: pretend to be a model in any default path.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from protocol.worker import ToolUse
from worker.backends.base import ModelShape, SpecialTokens, plain_turns
from worker.backends.plugin import Backend
from worker.backends.tool_format import GENERIC
from worker.engine.channel import TokenChannel
from worker.engine.embedder import Pooling
from worker.engine.endings import Endings, Progress, also_ending, assembler, cancel_session
from worker.engine.jobs import EngineConfig, EngineObserver, Failed, Finished, Job, StreamItem
from worker.errors import ConstraintError
from worker.sessions.messages import Message
from worker.sessions.table import Session, SessionTable

if TYPE_CHECKING:
    from worker.backends.base import EngineBackend, ModelBackend
    from worker.engine.embedder import EmbeddingContext
    from worker.settings import WorkerSettings

T = TypeVar("T")
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs", "away")


class SimulatedModel:
    """Just enough of `worker.backends.llama_model.Model` for admission: a name, a KV size and a tokenizer."""

    def __init__(self, *, name: str = "simulated", bytes_per_token: int = 23040, n_ctx_train: int = 1 << 20) -> None:
        self.name = name
        self.identity = f"simulated:{bytes_per_token}"
        self.max_token_bytes = 4  # its tokenizer: one token per 4 UTF-8 bytes
        self.bytes_per_token = bytes_per_token
        self.shape = ModelShape(n_layer=0, n_head=0, n_head_kv=0, n_embd=0, head_dim_k=0, head_dim_v=0,
                                n_ctx_train=n_ctx_train, n_vocab=len(WORDS))
        self.eog_tokens: tuple[int, ...] = ()
        self.backend, self.gpu_layers = "cpu", 0

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        data = text.encode()
        return [1] * int(add_special) + [data[i] % len(WORDS) for i in range(0, len(data), 4)]

    def piece(self, token: int) -> bytes:
        return (" " + WORDS[token]).encode() if 0 <= token < len(WORDS) else b""

    def meta_str(self, key: str) -> str | None:
        return None

    def special_tokens(self) -> SpecialTokens:
        return SpecialTokens(kind="simulated", bos=None, eos=None, add_bos=True, chat_template=None)

    turn_stop = None  # its words never spell a turn marker

    tool_format = GENERIC

    def render_chat(self, messages: list[Message], tools: ToolUse | None = None) -> str:
        return plain_turns(GENERIC.turns(messages, tools)[0])

    def constraint(self, *, grammar: str | None, json_schema: dict[str, Any] | None, lazy: bool = False) -> None:
        if grammar is not None or json_schema is not None:
            raise ConstraintError("the simulated engine does not constrain its output (grammar, json_schema)")

    def close(self) -> None:
        pass


class SimulatedEmbeddingContext:
    """`worker.backends.base.EmbeddingContext` without a model: the same bounds and unit-length vectors,
    so the embedding path (queue, deadlines, routing, wire formats) runs as with llama.cpp."""

    pooling: Pooling = "mean"

    def __init__(self, *, dimensions: int = 64, max_tokens: int = 512, max_inputs: int = 16) -> None:
        self.dimensions, self.max_tokens, self.max_inputs = dimensions, max_tokens, max_inputs
        # Its tokenizer's ids are 0..len(WORDS): one fixed vector each.
        self._table = np.random.default_rng(0).standard_normal((len(WORDS) + 1, dimensions))

    def embed(self, inputs: list[list[int]]) -> list[bytes]:
        out = []
        for tokens in inputs:
            vector = self._table[tokens].mean(axis=0)
            out.append((vector / np.linalg.norm(vector)).astype("<f4").tobytes())
        return out

    def close(self) -> None:
        pass


@dataclass(eq=False)
class _Running(Progress):
    ready_at: float = field(kw_only=True)  # prefill done


class SimulatedEngine:
    """Produces one token per running sequence every 1/token_rate seconds, after a simulated prefill."""

    def __init__(self, model: SimulatedModel, config: EngineConfig, *, token_rate: float, prefill_rate: float,
                 observer: EngineObserver | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.config = config
        self.token_rate = token_rate
        self.prefill_rate = prefill_rate
        self.table: SessionTable | None = None
        self._observer = observer or EngineObserver()
        self._clock = clock
        self._endings = Endings(config, self._observer, clock)
        self._inbox: collections.deque[Job] = collections.deque()
        self._running: list[_Running] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0

    ctx_tokens = property(lambda self: self.config.ctx_size)
    seq_tokens = property(lambda self: self.config.ctx_size if self.config.kv_unified
                          else self.config.ctx_size // self.config.max_sessions)
    queue_depth = property(lambda self: len(self._inbox))
    running = property(lambda self: sum(1 for run in self._running if run.choice == 0))  # requests
    active = property(lambda self: self.running + len(self._inbox))

    def bind(self, table: SessionTable) -> None:
        self.table = table

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task = loop.create_task(self._run(), name="simulated-engine")

    def stop(self, timeout: float = 5.0) -> None:
        if self._task is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)

    def submit(self, job: Job, free_first: tuple[int, ...] = ()) -> None:
        self._inbox.append(job)
        self._wake.set()

    def free(self, seq_ids: list[int] | tuple[int, ...]) -> None:
        pass  # no KV cells to clear; the session table already counts them free

    def poke(self) -> None:
        self._wake.set()

    def cancel_session(self, session: Session) -> None:
        cancel_session(session, (run.job for run in self._running), self._inbox)
        self._wake.set()

    async def _run(self) -> None:
        period = 1.0 / self.token_rate
        while True:
            if not self._running and not self._inbox:
                self._wake.clear()
                await self._wake.wait()
            now = self._clock()
            while self._inbox:
                job = self._inbox.popleft()
                todo = len(job.prompt_tokens) - job.cached_tokens
                del job.session.tokens[job.cached_tokens:]
                job.session.tokens.extend(job.prompt_tokens[job.cached_tokens:])
                for extra in job.extra_choices:  # what the real engine's copy of the prompt's cells holds
                    extra.session.tokens[:] = job.prompt_tokens
                for choice in range(job.n):
                    self._running.append(_Running(job=job, text=assembler(job, choice),
                                                  started_at=now, choice=choice,
                                                  ready_at=now + todo / self.prefill_rate))
            touched: set[TokenChannel[StreamItem]] = set()
            for run in list(self._running):
                if not run.ended:  # or it ended with another choice of its request, in this loop
                    self._advance(run, now, touched)
            self.steps += 1
            self._observer.step(len(self._running), 0, 0.0)
            for channel in touched:
                channel.wake()
            await asyncio.sleep(period)

    def _advance(self, run: _Running, now: float, touched: set[TokenChannel[StreamItem]]) -> None:
        endings = self._endings
        ended = endings.interrupted(run, now)
        if ended is not None:
            self._end(run, ended, touched)
            return
        if now < run.ready_at:
            return
        ready = endings.consumer(run, now)
        if ready is not True:
            if ready is not False:
                self._end(run, ready, touched)
            return
        token = (run.generated + run.choice) % len(WORDS)  # a continuation's words go on where they stopped
        reason = endings.accept(run, self.model.piece(token), 0.5, touched, token=token)
        if reason is not None:
            self._end(run, endings.finished(run, reason, now), touched)
        else:
            run.session.tokens.append(run.generated)

    def _end(self, run: _Running, outcome: Finished | Failed, touched: set[TokenChannel[StreamItem]]) -> None:
        if run.ended:
            return
        self._running.remove(run)
        run.ended = True
        completed = self._endings.completed(run, outcome, touched)
        assert self.table is not None
        if self.table.release(run.session, keep_kv=completed) is not None:
            run.session.tokens.clear()
        self._endings.deliver(run, outcome, touched)
        for other in also_ending(run, outcome, self._running):
            self._end(other, outcome, touched)


def _model(settings: WorkerSettings) -> ModelBackend:
    return SimulatedModel(bytes_per_token=settings.sim_bytes_per_token)


def _engine(settings: WorkerSettings, model: ModelBackend, config: EngineConfig, observer: EngineObserver,
            clock: Callable[[], float]) -> EngineBackend:
    return SimulatedEngine(cast(SimulatedModel, model), config, token_rate=settings.sim_token_rate,
                           prefill_rate=settings.sim_prefill_rate, observer=observer, clock=clock)


def _embeddings(settings: WorkerSettings, model: ModelBackend) -> EmbeddingContext:
    return SimulatedEmbeddingContext(max_tokens=settings.embedding_ctx, max_inputs=settings.embedding_batch_inputs)


# No KV cells to move (it implements neither KvTransfer nor PrefixExport): the worker answers 400 to
# those routes and never asks a peer for a prefix.
BACKEND = Backend("simulated", _model, _engine, _embeddings)
