"""The embedder: one thread that runs embedding requests through an `EmbeddingContext`, in turn.

Owns: what it needs of a backend (`EmbeddingContext`: token sequences in, unit vectors out), the bounded FIFO of embedding requests (`capacity` held at once, running or waiting: past it a
request is refused at once with 503 `embeddings_full`), each request's deadline, the thread and its
supervision, tokenizing each input and checking its length against the context, packing a request's
inputs into as few batches as fit (`pack`), and handing each result back to the event loop.
Must not: run on the event loop or touch the generation engine. Embedding requests never enter the
decode loop: the engine thread's steps go on while this thread computes, and the asyncio side only
waits on a future, with a deadline.

Supervision: an exception while serving one request (a bug, a llama.cpp failure) fails that request
with 500 `engine_failed`, is logged with its traceback and counted (`worker_internal_errors_total{task=
"embeddings"}`), and the thread takes the next one. A request whose caller stopped waiting (its
deadline passed) is skipped when its turn comes, or stopped between two batches.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from protocol import reasons
from worker.errors import WorkerError

log = logging.getLogger("worker.embedder")


Pooling = Literal["mean", "cls", "last"]


class EmbeddingContext(Protocol):
    """Turns token sequences into unit-length vectors. The embedder's one thread uses it, so an implementation may block: it never runs on the event loop."""

    dimensions: int  # the length of every vector
    max_tokens: int  # the most tokens one input, and one batch of inputs together, may have
    max_inputs: int  # the most inputs one batch may have
    pooling: Pooling  # how a sequence's token states become one vector

    def embed(self, inputs: list[list[int]]) -> list[bytes]:
        """One vector per input, in order: `dimensions` little-endian float32 values of unit length.
        Within the bounds above, the inputs are computed together (one batch)."""
        ...

    def close(self) -> None: ...


class EmbeddingObserver:
    """Hooks the metrics module implements; the default does nothing."""

    def embedding_batch(self, inputs: int, tokens: int, seconds: float) -> None: ...
    def internal_error(self, task: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Embedded:
    vectors: list[str]  # base64 of little-endian float32, one per input, in order
    tokens: list[int]  # each input's length in tokens
    dimensions: int


@dataclass(eq=False, slots=True)
class _Request:
    texts: list[str]
    deadline: float  # on the embedder's clock
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Embedded]
    abandoned: bool = False  # its caller stopped waiting: skip it, or stop it between batches


def pack(lengths: list[int], *, max_tokens: int, max_inputs: int) -> list[range]:
    """Consecutive inputs grouped into batches of at most `max_tokens` tokens and `max_inputs` inputs,
    in order, each batch as full as the next input allows. Every length must be <= `max_tokens`."""
    batches: list[range] = []
    start, tokens = 0, 0
    for i, length in enumerate(lengths):
        if i > start and (tokens + length > max_tokens or i - start >= max_inputs):
            batches.append(range(start, i))
            start, tokens = i, 0
        tokens += length
    if lengths:
        batches.append(range(start, len(lengths)))
    return batches


RATE_WEIGHT = 0.2  # weight of each batch's tokens a second in the running rate


class Embedder:
    def __init__(self, context: EmbeddingContext, tokenize: Callable[[str], list[int]], *, capacity: int,
                 timeout: float, observer: EmbeddingObserver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`tokenize`: the model's own, with its special tokens (called on this thread: it only reads
        the vocabulary). `timeout`: seconds a request may wait and run in all."""
        self.context = context
        self.capacity = capacity
        self.timeout = timeout
        self._tokenize = tokenize
        self._observer = observer or EmbeddingObserver()
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._held = 0  # requests queued or running: at most `capacity`
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.rate: float | None = None  # tokens a second this context embeds, exponentially weighted

    @property
    def held(self) -> int:
        return self._held

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="embedder", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Refuses what still waits (503 `draining`), lets the running request finish, frees the context."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # a batch still runs on it: freeing the context under it would crash the process
        self.context.close()

    async def embed(self, texts: list[str]) -> Embedded:
        """The vectors of `texts`, or a `WorkerError`: 503 `embeddings_full` at once when `capacity`
        requests are held; 413 `prompt_too_long`, 400 `invalid_request`, 504 `deadline_exceeded`, 500
        `engine_failed` once its turn has come."""
        loop = asyncio.get_running_loop()
        request = _Request(texts, self._clock() + self.timeout, loop, loop.create_future())
        with self._cond:
            if self._stopping:
                raise WorkerError(reasons.DRAINING, "the worker is shutting down")
            if self._thread is None or not self._thread.is_alive():
                raise WorkerError(reasons.ENGINE_FAILED, "the embedding thread is not running")
            if self._held >= self.capacity:
                raise WorkerError(reasons.EMBEDDINGS_FULL, f"{self._held} embedding requests are held here, "
                                  "its limit (--embedding-queue)")
            self._held += 1
            self._queue.append(request)
            self._cond.notify()
        try:
            return await asyncio.wait_for(request.future, self.timeout)
        except TimeoutError:
            raise WorkerError(reasons.DEADLINE_EXCEEDED, f"not embedded within {self.timeout:g} s "
                              "(--embedding-timeout)") from None
        finally:
            request.abandoned = True  # answered, timed out or cancelled: the thread need not go on

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                request = self._queue.popleft()
            outcome: Embedded | WorkerError | None
            try:
                outcome = self._serve(request)
            except WorkerError as refused:
                outcome = refused
            except Exception:  # supervised: this request fails (traceback logged), the thread goes on
                log.exception(json.dumps({"event": "internal_error", "task": "embeddings"}))
                self._observer.internal_error("embeddings")
                outcome = WorkerError(reasons.ENGINE_FAILED, "the embedding context failed; its log says why")
            finally:
                with self._cond:
                    self._held -= 1
            if outcome is not None:
                _deliver(request, outcome)
        with self._cond:
            left, self._queue = list(self._queue), collections.deque()
            self._held -= len(left)
        for request in left:
            _deliver(request, WorkerError(reasons.DRAINING, "the worker is shutting down"))

    def _serve(self, request: _Request) -> Embedded | None:
        """None: nobody waits for it any more."""
        if request.abandoned:
            return None
        context = self.context
        inputs = self._inputs(request.texts)
        total = left = sum(map(len, inputs))
        self._affordable(request, total, left)
        vectors: list[str] = []
        for batch in pack([len(t) for t in inputs], max_tokens=context.max_tokens, max_inputs=context.max_inputs):
            if request.abandoned or self._clock() > request.deadline:
                return None  # its caller has answered 504 already, or is about to
            chosen = [inputs[i] for i in batch]
            vectors.extend(self._batch(chosen))
            left -= sum(map(len, chosen))
            if left:
                self._affordable(request, total, left)  # the first request measures the rate as it goes
        return Embedded(vectors, [len(t) for t in inputs], context.dimensions)

    def _inputs(self, texts: list[str]) -> list[list[int]]:
        """Each text's tokens; 400 for one with none, 413 for one past the context's length."""
        inputs = [self._tokenize(text) for text in texts]
        for i, tokens in enumerate(inputs):
            if not tokens:
                raise WorkerError(reasons.INVALID_REQUEST, f"inputs.{i}: no tokens to embed")
            if len(tokens) > self.context.max_tokens:
                raise WorkerError(reasons.PROMPT_TOO_LONG, f"input {i} is {len(tokens)} tokens; this model "
                                  f"embeds at most {self.context.max_tokens} tokens an input (--embedding-ctx)")
        return inputs

    def _batch(self, chosen: list[list[int]]) -> list[str]:
        """One batch's vectors, base64; its time goes into the measured rate."""
        started = time.perf_counter()
        vectors = [base64.b64encode(v).decode("ascii") for v in self.context.embed(chosen)]
        seconds = time.perf_counter() - started
        embedded = sum(map(len, chosen))
        self._observer.embedding_batch(len(chosen), embedded, seconds)
        if seconds > 0:
            measured = embedded / seconds
            self.rate = measured if self.rate is None else self.rate + RATE_WEIGHT * (measured - self.rate)
        return vectors

    def _affordable(self, request: _Request, tokens: int, left: int) -> None:
        """Refuses a request this context cannot finish in time at the rate it has measured, before any of
        it is embedded (or, while the first request measures the rate, after its first batch): 413 when
        it could not even alone within `timeout` (send fewer inputs a request), 503 `embeddings_full`
        when what is `left` of it needs more than the deadline leaves (another worker may have it
        sooner). Before, the largest request the pool accepts ran 30 s on one worker and then on the
        next, and was answered 504 or 502 (issue 33)."""
        if self.rate is None:
            return
        needs = tokens / self.rate
        if needs > self.timeout:
            raise WorkerError(reasons.PROMPT_TOO_LONG, f"these inputs are {tokens:,} tokens: about {needs:.0f} s "
                              f"at this worker's {self.rate:,.0f} tokens a second, past its {self.timeout:g} s "
                              "(--embedding-timeout); send fewer inputs a request")
        remaining = left / self.rate
        time_left = request.deadline - self._clock()
        if remaining > time_left:
            raise WorkerError(reasons.EMBEDDINGS_FULL, f"these inputs need about {remaining:.1f} s more here "
                              f"and {max(0.0, time_left):.1f} s of the deadline is left")


def _deliver(request: _Request, outcome: Embedded | WorkerError) -> None:
    """From the embedder's thread to the request's event loop; nothing if the loop is gone."""
    with contextlib.suppress(RuntimeError):  # the loop was closed (the server stopped)
        request.loop.call_soon_threadsafe(_settle, request.future, outcome)


def _settle(future: asyncio.Future[Embedded], outcome: Embedded | WorkerError) -> None:
    if future.done():  # cancelled by its deadline
        return
    if isinstance(outcome, WorkerError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
