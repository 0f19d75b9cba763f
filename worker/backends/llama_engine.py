"""The continuously batched decode loop: one thread, one llama.cpp context, every request in one batch.

Owns: the llama.cpp context and its batch, the running sequences, prefill chunking, sampling, ending
a sequence (EOG, max_tokens, KV limit, stop string, cancel, slow consumer) and freeing its KV cells,
and the further choices of a request with `n` > 1: its prompt is prefilled once, in choice 0's
sequence; in the step that decodes its last prompt token the other choices' sequences get a copy of
those cells (`llama_memory_seq_cp`, made by llama.cpp at the start of the next decode) and their
first tokens are drawn, each by its own sampler, from that same row of logits; from then on each
choice is a sequence of its own in the batch.
Must not: block on a consumer or touch asyncio objects other than through `TokenChannel` and
`loop.call_soon_threadsafe`. Each step puts one token of every generating sequence, plus prompt
tokens of joining sequences (the shortest remaining prompt first, up to `prefill_chunk`), into a single
`llama_decode` call; beside decoding rows only when they are owed no time (worker/engine/pacing.py),
so that a long prompt slows the streams beside it by at most `prefill_stall` times.

Scoring a prompt (`prompt_logprobs`, what `echo` with `logprobs` reads): the request's whole prompt is
prefilled (cached cells hold no logits), in chunks of at most SCORE_CHUNK, each of its rows asking
llama.cpp for logits; the rows score the tokens that follow them (worker/engine/scoring.py), and the
scores go to its consumer just before its first token. Other requests' steps are as they were.

Parking (preemption, `park`): for an interactive request that finds every sequence taken, one running
batch request (one choice, one-shot, its prompt prefilled: the latest started of those) has its cells
saved to host memory as llama.cpp saves a sequence (the bytes a session move sends), its sequence
cleared and given back to the table. It keeps everything else it had (its sampled next token, its
sampler and grammar state, its text), so when a sequence is free again and no newer batch request
may take it first (worker/sessions/table.py, parking), its cells are written into that sequence and
it goes on from the token it stopped at: its client sees a pause, and its output is what it would
have been. Parked requests resume first parked, first resumed, before each step. While an interactive
request's prompt is prefilled, batch sequences sit out those steps (their decoding rows and their
prompts' chunks): its first token does not wait for a batch-wide decode. A step that carries batch rows
is cut short when an interactive request comes (worker/backends/llama_interrupt.py): the rows it carried
go back where they were (`_put_back`: their cells, tokens, next token and prompt rest) and go in again.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import llama_cpp as ll
import numpy as np

from protocol import reasons
from worker.backends.llama_interrupt import StepInterrupt
from worker.backends.llama_model import Model
from worker.engine.batch_share import BatchShare
from worker.engine.channel import TokenChannel
from worker.engine.endings import Endings, Progress, also_ending, assembler, cancel_session
from worker.engine.jobs import EngineConfig, EngineObserver, Failed, Finished, Job, PromptScored, StreamItem
from worker.engine.line import prefill_order
from worker.engine.pacing import PrefillPace
from worker.engine.sampling import RequestSampling, SamplingParams, StepSampler, choice_seed, top_alternatives
from worker.engine.scoring import SCORE_CHUNK, PromptScores
from worker.sessions.host_cache import HostCache
from worker.sessions.table import Session, SessionTable
from worker.sessions.transfer import Origin

log = logging.getLogger("worker.backends.llama_engine")
# Seconds the step after a park waits, at most, for the request admitted in the parked one's place
# (the event loop builds its job and submits it): its prefill joins that step instead of the next.
PARK_HANDOVER = 0.05
T = TypeVar("T")


@dataclass(eq=False)
class _Running(Progress):
    sampling: RequestSampling = field(kw_only=True)
    todo: list[int] = field(kw_only=True)  # prompt tokens still to prefill
    next_token: int | None = None  # sampled, not yet decoded
    # Choice 0 of several: the other choices, waiting for its prompt's cells (then copied to them).
    waiting: list[_Running] = field(default_factory=list, kw_only=True)
    copied: bool = field(default=True, kw_only=True)  # False while a further choice waits for its copy
    # A request that scores its prompt (`prompt_logprobs`): the scores so far, until they are delivered.
    scores: PromptScores | None = field(default=None, kw_only=True)


@dataclass(eq=False)
class _Parked:
    run: _Running
    cells: bytes  # the sequence as llama.cpp saved it (its positions: the session's tokens, kept meanwhile)
    at: float  # when it was parked (engine clock)


class Engine:
    def __init__(self, model: Model, config: EngineConfig, *,
                 observer: EngineObserver | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.config = config
        self.table: SessionTable | None = None  # bound once the limits are known from this context
        self._observer = observer or EngineObserver()
        self._clock = clock
        self._endings = Endings(config, self._observer, clock)
        params = ll.llama_context_default_params()
        params.n_ctx = config.ctx_size
        params.n_batch = params.n_ubatch = config.prefill_chunk + config.max_sessions
        params.n_seq_max = config.max_sessions
        params.n_threads = params.n_threads_batch = config.threads
        params.kv_unified = config.kv_unified
        params.flash_attn_type = config.flash_attn
        # Sliding-window layers (Gemma 3) keep every token, like the global ones: KV bytes stay
        # tokens x model.bytes_per_token, and cutting a session back keeps its window (see
        # ModelShape.kv_bytes_per_token). llama.cpp's default is true today; we do not depend on it.
        params.swa_full = True
        params.type_k = params.type_v = model.kv_type
        params.no_perf = True
        self._ctx = ll.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context with these settings")
        self._mem = ll.llama_get_memory(self._ctx)
        # A step carrying batch rows is cut short when an interactive request comes (llama_interrupt.py).
        self._interrupt = StepInterrupt() if config.cut_batch_steps else None
        if self._interrupt is not None:
            self._interrupt.install(self._ctx)
        self._n_batch = params.n_batch
        self._batch = ll.llama_batch_init(self._n_batch, 0, 1)
        self._rows = _BatchRows(self._batch, self._n_batch)
        self._sampler = StepSampler(model.shape.n_vocab)
        self._cond = threading.Condition()
        # Bounded by admission, not by a maxlen: jobs <= sequence slots, frees <= slots, one cancel per
        # DELETE request; the loop drains it whole at every step.
        self._inbox: collections.deque[Job | tuple[str, Any]] = collections.deque()
        self._running: list[_Running] = []
        # Parked batch requests, the first parked first: at most one per interactive request admitted
        # in its place, so no more than the sequences (each held one when it was parked).
        self._parked: collections.deque[_Parked] = collections.deque()
        # After a park, until this time (engine clock): the request admitted in its place is on its way,
        # and the next step waits for it rather than leave its prefill to the step after (a whole step).
        self._awaited = 0.0
        self._loop: Any = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._copied: set[int] = set()  # sequences whose copy llama.cpp makes at the next decode
        self._sources: set[int] = set()  # the sequences those copies are made from
        self._woke_at = 0.0  # time.monotonic() of the last wake of the event loop (`_wake`)
        self._urgent = False  # a first token, or a prompt's scores, waits for the next wake
        self.pace = PrefillPace(stall=config.prefill_stall)
        self.share = BatchShare(config.batch_slowdown)
        self.steps = 0
        # Leftover cells saved to host memory when another request takes their sequence (engine thread).
        self.host_cache = HostCache(config.host_cache_bytes if config.prompt_cache and not config.kv_unified else 0)

    # -- facts the admission needs -------------------------------------------------------------------

    @property
    def ctx_tokens(self) -> int:
        return ll.llama_n_ctx(self._ctx)

    @property
    def seq_tokens(self) -> int:
        """Cells one sequence can reach: the whole context if unified, else its equal share."""
        return ll.llama_n_ctx_seq(self._ctx)

    @property
    def queue_depth(self) -> int:
        with self._cond:  # the engine thread swaps the inbox out under this lock
            return sum(1 for item in self._inbox if isinstance(item, Job))

    @property
    def running(self) -> int:
        """Requests generating or prefilling (a request of several choices runs several sequences)."""
        return sum(1 for run in self._running if run.choice == 0)

    @property
    def active(self) -> int:
        return self.running + self.queue_depth

    @property
    def parkable(self) -> int:
        """Batch requests running now that `park` could park (a reading for heartbeats: approximate)."""
        return sum(1 for run in list(self._running) if self._can_park(run))

    def bind(self, table: SessionTable) -> None:
        self.table = table

    def scores_prompts(self) -> Literal[True]:
        return True

    # -- control (any thread) ------------------------------------------------------------------------

    def start(self, loop: Any) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # a step still runs on it: freeing the context under it would crash the process
        self._rows.give_back(self._batch)
        ll.llama_batch_free(self._batch)
        ll.llama_free(self._ctx)
        self._ctx = None

    def submit(self, job: Job, free_first: tuple[int, ...] = ()) -> None:
        with self._cond:
            if free_first:
                self._inbox.append(("free", free_first))
            self._inbox.append(job)
            self._cond.notify()
        if self._interrupt is not None and job.request.priority == "interactive":
            self._interrupt.request()

    def free(self, seq_ids: list[int] | tuple[int, ...]) -> None:
        if seq_ids:
            with self._cond:
                self._inbox.append(("free", tuple(seq_ids)))
                self._cond.notify()

    def cancel_session(self, session: Session) -> None:
        """Cancels whatever request is generating on `session` (at the engine's next step)."""
        with self._cond:
            self._inbox.append(("cancel", session))
            self._cond.notify()

    def poke(self) -> None:
        """A consumer cancelled or drained its channel: look again now rather than at the next poll."""
        with self._cond:
            self._cond.notify()

    def park(self, then: Callable[[], T]) -> concurrent.futures.Future[T | None]:
        """Parks one running batch request between two steps, freeing its sequence, and calls `then` (the
        interactive request's admission) on this thread before any parked request could take the sequence
        back: what it returns (or raises), or None when none could be parked."""
        future = self.call(lambda ctx: then() if self._park_one(ctx) else None)
        if self._interrupt is not None:
            self._interrupt.request()
        return future

    def cells_origin(self) -> Origin:
        return Origin(self.model.identity, self.model.kv_type, ll.__version__, self.model.shape.n_vocab)

    def export_cells(self, seq_id: int) -> concurrent.futures.Future[bytes]:
        """A sequence's cells as llama.cpp saves them, read between two steps."""
        return self.call(lambda ctx: _read_cells(ctx, seq_id))

    def export_prefix(self, prompt: list[int], tenant: str, at_least: int
                      ) -> concurrent.futures.Future[tuple[list[int], bytes] | None]:
        """The sequence here whose cells hold the longest prefix of `tenant`'s `prompt` (at least
        `at_least` tokens; running, kept or a leftover): what its cells hold and their bytes, read
        between two steps (where the table's tokens are exactly the cells); None when none does."""
        def read(ctx: Any) -> tuple[list[int], bytes] | None:
            if self.table is None or self.config.kv_unified:
                return None
            found = self.table.prefix_source(prompt, tenant=tenant, at_least=at_least, skip=set(self._copied))
            if found is None:
                return None
            held = self.table.tokens_of(found[0])
            return (held, _read_cells(ctx, found[0])) if held is not None else None
        return self.call(read)

    def import_cells(self, seq_id: int, cells: bytes | memoryview, keep: int | None = None
                     ) -> concurrent.futures.Future[int]:
        """Writes saved cells into `seq_id` (emptied first), between two steps, keeping its first `keep`
        positions only when given: how many it then holds, or 0 when llama.cpp refused them (the
        sequence is left empty)."""
        return self.call(lambda ctx: self._write_cells(ctx, seq_id, cells, keep))

    def _write_cells(self, ctx: Any, seq_id: int, cells: bytes | memoryview, keep: int | None = None) -> int:
        """Engine thread: `cells` written into `seq_id`, emptied first (its first `keep` positions kept,
        when given); the positions it then holds, 0 when llama.cpp refused them (left empty)."""
        ll.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        buffer = (ctypes.c_uint8 * len(cells)).from_buffer_copy(cells)
        if int(ll.llama_state_seq_set_data(ctx, buffer, len(cells), ctypes.c_int32(seq_id))) != len(cells):
            ll.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            return 0
        if keep is not None:
            ll.llama_memory_seq_rm(self._mem, seq_id, keep, -1)
        return int(ll.llama_memory_seq_pos_max(self._mem, seq_id)) + 1

    def call(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Runs `fn(ctx)` on the engine thread between two steps (for reads of llama.cpp state)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            self._inbox.append(("call", (fn, future)))
            self._cond.notify()
        return future

    # -- the loop (engine thread) --------------------------------------------------------------------

    def _run(self) -> None:
        touched: set[TokenChannel[StreamItem]] = set()  # channels pushed to since the event loop was woken
        while True:
            with self._cond:
                if not self._inbox and not self._running and not self._stopping:
                    self.pace.idle()  # nothing to do: whoever comes now waits out no step
                    # A parked request waits for a sequence that the event loop may free (a request
                    # that never started): look again soon.
                    self._cond.wait(timeout=0.02 if self._parked else 1.0)
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, collections.deque()
            try:
                self._cycle(inbox, touched)
            except Exception:  # a bug or llama.cpp failure must not leave streams hanging
                log.exception("engine step failed")  # the exception's text goes here, not to clients
                self._observer.internal_error("engine_step")
                for run in list(self._running):  # a request's other choices end with its first
                    self._end(run, Failed(reasons.ENGINE_FAILED, "the engine failed; its log says why"), touched)
            self._wake(touched, force=not self._running)
        self._wake(touched, force=True)
        for run in list(self._running):
            self._end(run, Failed(reasons.DRAINING, "worker is shutting down"), set())
        while self._parked:
            self._end_parked(self._parked.popleft(), Failed(reasons.DRAINING, "worker is shutting down"), set())

    def _cycle(self, inbox: collections.deque[Job | tuple[str, Any]], touched: set[TokenChannel[StreamItem]]) -> None:
        """One turn of the loop: what came in, the parked requests that can resume, then a step."""
        for item in inbox:
            self._take(item, touched)
        if self._awaited:
            self._hand_over(touched)
        if self._parked:
            self._resume(touched)
        if self._running and not self._step(touched):
            self._wake(touched, force=True)
            with self._cond:  # every sequence waits for its consumer: poll gently
                self._cond.wait(timeout=0.005)

    def _wake(self, touched: set[TokenChannel[StreamItem]], *, force: bool) -> None:
        """Wakes the event loop for the channels pushed to (one hand-off for all of them), at most once
        per `wake_interval` of steps: the streams reached late write what came meanwhile as one chunk,
        so the sockets on both sides of the coordinator carry several tokens a write. At once when
        `force`d, when a request's first token (or its prompt's scores) is among them, and when one
        has ended: time to first token and to the end do not wait."""
        if not touched:
            return
        now = time.monotonic()  # wall pacing, whatever clock the engine's deadlines use
        if force or self._urgent or now - self._woke_at >= self.config.wake_interval \
                or any(channel.closed for channel in touched):
            self._loop.call_soon_threadsafe(_wake_all, list(touched))
            touched.clear()
            self._urgent = False
            self._woke_at = now

    def _hand_over(self, touched: set[TokenChannel[StreamItem]]) -> None:
        """After a park: waits (`PARK_HANDOVER` at most) for the job admitted in the parked request's
        place, and takes what came in meanwhile, so that its prefill joins the coming step."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or any(isinstance(i, Job) for i in self._inbox),
                                timeout=max(0.0, self._awaited - self._clock()))
            self._awaited = 0.0
            inbox, self._inbox = self._inbox, collections.deque()
        for item in inbox:
            self._take(item, touched)

    def _take(self, item: Job | tuple[str, Any], touched: set[TokenChannel[StreamItem]]) -> None:
        if isinstance(item, Job):
            self._begin(item, touched)
        elif item[0] == "free":
            for seq_id in item[1]:
                ll.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        elif item[0] == "cancel":
            # The event loop appends to the inbox under the lock; walking it unlocked could see it
            # mutate mid-iteration (RuntimeError) and end every running stream as an engine failure.
            with self._cond:
                queued = [job for job in self._inbox if isinstance(job, Job)]
            cancel_session(item[1], (run.job for run in (*self._running, *(p.run for p in self._parked))), queued)
        elif item[0] == "call":
            fn, future = item[1]
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self._ctx))
                except Exception as exc:  # noqa: BLE001 - any failure belongs to the caller's future
                    future.set_exception(exc)

    def _begin(self, job: Job, touched: set[TokenChannel[StreamItem]]) -> None:
        session, keep = job.session, job.cached_tokens
        if job.channel.cancelled:
            self._release(session, keep_kv=session.session_id is not None)
            for extra in job.extra_choices:  # never filled: their cells hold another request's tokens
                self._release(extra.session, keep_kv=False, clean=False)
            return
        self._spill(session, keep)
        for extra in job.extra_choices:
            self._spill(extra.session, 0)
        source = self._prefix_source(job) if job.request.prompt_logprobs is None else None
        restored = None if job.request.prompt_logprobs is not None else \
            self._restore(job, max(keep, source[1] if source is not None else 0))
        if restored is not None:
            keep = restored
        elif source is not None:
            keep = job.cached_tokens = job.copied_tokens = self._copy_prefix(source, session, job.prompt_tokens)
        elif not ll.llama_memory_seq_rm(self._mem, session.seq_id, keep, -1):
            keep = 0  # this memory type cannot drop a tail: start the sequence over
            ll.llama_memory_seq_rm(self._mem, session.seq_id, -1, -1)
        del session.tokens[keep:]
        request = job.request
        params = SamplingParams(request.temperature, request.top_p, request.top_k, request.seed,
                                self.model.eog_tokens if request.ignore_eos else (), request.probabilities,
                                logit_bias=tuple((int(t), b) for t, b in request.logit_bias.items()),
                                presence_penalty=request.presence_penalty,
                                frequency_penalty=request.frequency_penalty,
                                repeat_penalty=request.repeat_penalty, repeat_last_n=request.repeat_last_n)
        now = self._clock()
        prompt = job.prompt_tokens[:job.prompt_length]
        run = _Running(job=job, text=assembler(job), started_at=now,
                       sampling=RequestSampling(params, job.constraint, prompt, job.prompt_tokens[len(prompt):]),
                       todo=job.prompt_tokens[keep:],
                       scores=None if request.prompt_logprobs is None else PromptScores(job.prompt_tokens,
                                                                                          request.prompt_logprobs))
        run.waiting = [
            _Running(job=job, choice=extra.index, text=assembler(job, extra.index),
                     started_at=now, todo=[], copied=False,
                     sampling=RequestSampling(dataclasses.replace(params, seed=choice_seed(params.seed, extra.index)),
                                              extra.constraint, job.prompt_tokens))
            for extra in job.extra_choices]
        for each in (run, *run.waiting):
            # Kept in sequence-id order so each step's decode rows reach llama.cpp ascending (one pass).
            # A waiting choice has neither prompt left nor a token: no step puts it in the batch.
            bisect.insort(self._running, each, key=lambda r: r.session.seq_id)

    # -- parking (engine thread) --------------------------------------------------------------------

    @staticmethod
    def _can_park(run: _Running) -> bool:
        """A batch request of one choice and no kept session, its prompt in its cells."""
        job = run.job
        return (job.request.priority == "batch" and job.n == 1 and job.session.session_id is None
                and not run.ended and not run.todo)

    def _park_one(self, ctx: Any) -> bool:
        assert self.table is not None
        # Between two steps, also with its next token sampled (nothing half done), and its cells no copy
        # still to be made.
        candidates = [run for run in self._running if self._can_park(run) and run.next_token is not None
                      and run.session.seq_id not in self._copied]
        if not candidates:
            return False
        run = max(candidates, key=lambda r: r.started_at)  # the latest started: the least to save
        session = run.session
        cells = _read_cells(ctx, session.seq_id)
        ll.llama_memory_seq_rm(self._mem, session.seq_id, -1, -1)
        self._running.remove(run)
        self._parked.append(_Parked(run, cells, self._clock()))
        self.table.park(session)  # its release hooks wake the request waiting for this sequence
        self._observer.parked(len(cells))
        self._awaited = self._clock() + PARK_HANDOVER
        return True

    def _resume(self, touched: set[TokenChannel[StreamItem]]) -> None:
        """Ends the parked requests cancelled or past their deadline, then resumes the others in the
        order they were parked while the table finds each a sequence."""
        assert self.table is not None
        now = self._clock()
        endings = [(p, self._endings.interrupted(p.run, now)) for p in self._parked]
        for parked, ending in endings:
            if ending is not None:
                self._parked.remove(parked)
                self._end_parked(parked, ending, touched)
        while self._parked:
            parked = self._parked[0]
            session = parked.run.session
            freed = self.table.unpark(session)
            if freed is None:
                return
            self._parked.popleft()
            for seq_id in freed:
                ll.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            self._spill(session, 0)
            held = self._write_cells(self._ctx, session.seq_id, parked.cells)
            bisect.insort(self._running, parked.run, key=lambda r: r.session.seq_id)
            if held != len(session.tokens):
                self._end(parked.run, Failed(reasons.ENGINE_FAILED, "a parked request's cells did not come back"),
                          touched)
                continue
            self._observer.resumed(now - parked.at)

    def _end_parked(self, parked: _Parked, outcome: Finished | Failed, touched: set[TokenChannel[StreamItem]]) -> None:
        """Ends a parked request (it holds no sequence: nothing to clear)."""
        assert self.table is not None
        run = parked.run
        run.ended = True
        self._endings.completed(run, outcome, touched)
        self.table.drop_parked(run.session)
        self._endings.deliver(run, outcome, touched)

    def _prefix_source(self, job: Job) -> tuple[int, int] | None:
        """(sequence, tokens) of another sequence holding a longer prefix of the prompt, worth a copy."""
        if not self.config.prompt_cache or self.config.kv_unified or self.table is None:
            return None
        # A sequence whose own copy is still pending holds nothing yet; one prompt token is always
        # decoded, for the logits of the first generated token.
        return self.table.prefix_source(job.prompt_tokens[:-1], tenant=job.session.tenant,
                                        at_least=job.cached_tokens + self.config.prefix_min_tokens,
                                        skip=self._copied | {job.session.seq_id})

    # -- the prompt cache in host memory (engine thread) ---------------------------------------------

    def _spill(self, session: Session, kept: int) -> None:
        """Saves to host memory the interactive leftover cells `session`'s sequence held when it was taken
        (`Session.displaced`), unless the request keeps most of them (its own tenant's, `kept` tokens) or
        they are fewer than `prefix_min_tokens`; before anything clears them."""
        displaced, session.displaced = session.displaced, None
        cache = self.host_cache
        if displaced is None or not cache.limit_bytes:
            return
        tenant, tokens = displaced
        least = self.config.prefix_min_tokens
        if len(tokens) < least or (tenant == session.tenant and kept > len(tokens) - least):
            return
        size = int(ll.llama_state_seq_get_size(self._ctx, ctypes.c_int32(session.seq_id)))
        if cache.takes(size) and cache.put(tenant, tokens, _read_cells(self._ctx, session.seq_id)):
            self._observer.spilled(size)

    def _restore(self, job: Job, have: int) -> int | None:
        """Writes into the job's sequence the cells of its tenant saved in host memory that hold the
        longest prefix of its prompt, when that is at least `prefix_min_tokens` more than the `have`
        its own cells or a copy would give: the tokens it then holds (0: llama.cpp refused them, the
        sequence is empty), None when none does."""
        cache, session = self.host_cache, job.session
        if not len(cache) or session.seq_id in self._sources:
            return None  # a copy still to be made from this sequence reads its cells as they are now
        found = cache.best(session.tenant, job.prompt_tokens[:-1], at_least=have + self.config.prefix_min_tokens)
        if found is None:
            return None
        entry, n = found
        held = self._write_cells(self._ctx, session.seq_id, entry.cells, keep=n)
        session.tokens[:] = job.prompt_tokens[:held]
        job.cached_tokens = held
        if held:
            self._observer.restored(held)
        return held

    def _copy_prefix(self, source: tuple[int, int], session: Session, prompt: list[int]) -> int:
        """Makes `session`'s sequence hold the first cells of `source`. Split KV: llama.cpp copies the
        source's whole stream at the start of the next llama_decode (before that decode writes any
        cell); the copy's cells past the prefix are dropped at once."""
        src, n = source
        ll.llama_memory_seq_cp(self._mem, src, session.seq_id, -1, -1)
        ll.llama_memory_seq_rm(self._mem, session.seq_id, n, -1)
        session.tokens[:] = prompt[:n]
        self._copied.add(session.seq_id)
        self._sources.add(src)
        return n

    def _step(self, touched: set[TokenChannel[StreamItem]]) -> bool:
        """Decodes one batch; returns False when nothing could be scheduled. A request of several
        choices whose prompt this batch completes has its other choices filled and sampled here."""
        rows: list[_Running] = []  # the runs whose last row in the batch asks for logits, in batch order
        scored: list[tuple[int, _Running, int]] = []  # prompt rows scored: (output row, run, position)
        before = [(run, run.next_token, len(run.session.tokens), run.todo) for run in self._running]
        # An interactive request's prompt goes in beside interactive sequences only: batch ones sit its
        # prefill out, their decoding rows and their prompts' chunks (its first token comes a batch step
        # sooner); beside interactive ones decoding, they join as their share allows (engine/batch_share.py).
        urgent = any(r.todo and r.job.request.priority == "interactive" for r in self._running)
        sit_out = urgent or not self.share.admits(
            interactive=any(r.job.request.priority == "interactive" for r in self._running))
        decoding = self._add_generated(rows, touched, sit_out)
        n, prefilling = self._add_prompts(decoding, rows, scored, sit_out)
        if n == 0:
            return False
        self._batch.n_tokens = n
        carried = [each for each in before if len(each[0].session.tokens) != each[2] and not each[0].ended]
        classes = {run.job.request.priority for run, *_ in carried}  # the priority classes the step carries
        started, cpu = time.perf_counter(), time.thread_time()
        if not self._decode(carried, batch_rows="batch" in classes):
            self._observer.decode_cpu(time.thread_time() - cpu)
            self._observer.step_cut(time.perf_counter() - started)
            return True  # cut for an interactive request: the step's rows go in again, after it
        self.steps += 1
        seconds = time.perf_counter() - started
        self._observer.step_spent("both" if len(classes) > 1 else next(iter(classes), "interactive"), seconds)
        self.share.observe(seconds, interactive="interactive" in classes, batch="batch" in classes, prompt=n - decoding)
        self._observer.decode_cpu(time.thread_time() - cpu)
        self.pace.observe(decoding, n - decoding, seconds, joining=len(rows) - decoding)
        self._observer.step(decoding + prefilling, n - decoding, seconds, decoding)
        if rows or scored:
            self._sample(rows, scored, touched)
        return True

    def _decode(self, carried: list[tuple[_Running, int | None, int, list[int]]], *, batch_rows: bool) -> bool:
        """llama_decode of the batch filled; False when an interactive request cut it short (what it
        `carried` is then put back; only a step with `batch_rows` may be cut)."""
        interrupt = self._interrupt
        if interrupt is not None:
            interrupt.arm(batch_rows=batch_rows)
        status = ll.llama_decode(self._ctx, self._batch)
        self._copied.clear()  # made at the start of that decode
        self._sources.clear()
        if interrupt is not None:
            interrupt.ended(status == 2)
        if status == 2:
            self._put_back(carried)
            return False
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return True

    def _sample(self, rows: list[_Running], scored: list[tuple[int, _Running, int]],
                touched: set[TokenChannel[StreamItem]]) -> None:
        """The step's tokens: llama.cpp keeps the logits of the rows that ask for them contiguous, in
        batch order, and the step samples them all from one view of its buffer."""
        logits = np.ctypeslib.as_array(ll.llama_get_logits(self._ctx),
                                       shape=(len(rows) + len(scored), self.model.shape.n_vocab))
        if scored:
            logits = self._score(logits, scored)
        if any(run.waiting for run in rows):
            rows, logits = self._with_choices(rows, logits)
        picks = self._sampler.sample(logits, [run.sampling for run in rows])
        now, gaps = self._clock(), list[float]()
        for i, (run, (token, probability)) in enumerate(zip(rows, picks, strict=True)):
            # Only in the step that ends a scored prompt (max_tokens 0 needs scores: the prompt alone).
            if run.scores is not None and self._deliver_scores(run, touched):
                self._end(run, self._endings.finished(run, "length"), touched)
            elif not run.ended:
                alternatives = self._alternatives(run, logits[i]) if run.job.request.alternatives else ()
                self._accept(run, token, probability, touched, alternatives, now, gaps)
        self._observer.token_gaps(gaps)

    @staticmethod
    def _score(logits: np.ndarray, scored: list[tuple[int, _Running, int]]) -> np.ndarray:
        """Fills the scores of the prompt rows in this step's logits; the other rows (those sampled)."""
        by_run: dict[_Running, list[tuple[int, int]]] = {}
        for at, run, position in scored:
            by_run.setdefault(run, []).append((at, position))
        for run, found in by_run.items():
            assert run.scores is not None
            run.scores.fill(logits[[at for at, _ in found]], [position for _, position in found])
        skip = {at for at, _, _ in scored}
        return logits[[i for i in range(logits.shape[0]) if i not in skip]]

    def _deliver_scores(self, run: _Running, touched: set[TokenChannel[StreamItem]]) -> bool:
        """A scored prompt's scores, to its consumer ahead of its first token (once); True when the request
        asked for nothing more (max_tokens 0) and is still running, to be ended now."""
        scores, run.scores = run.scores, None
        assert scores is not None
        tokens, top = scores.texts(self.model.piece)
        run.job.channel.push(PromptScored(tokens, scores.logprobs, top))
        touched.add(run.job.channel)
        self._urgent = True
        return not run.ended and run.job.request.max_tokens == 0

    def _with_choices(self, rows: list[_Running], logits: np.ndarray) -> tuple[list[_Running], np.ndarray]:
        """The step's rows with, after each choice 0 whose prompt is now in its cells, its other choices:
        each gets a copy of those cells (before any ending of this step can free them) and samples its
        first token from the same row of logits (a copy of the rows, made once per such request)."""
        owners: list[_Running] = []
        at: list[int] = []
        for i, run in enumerate(rows):
            owners.append(run)
            at.append(i)
            for other in run.waiting:
                if other.ended:
                    continue
                self._copy_prompt(run.session, other)
                owners.append(other)
                at.append(i)
            run.waiting = []
        return owners, logits[at]

    def _copy_prompt(self, source: Session, run: _Running) -> None:
        """Fills a further choice's sequence with choice 0's cells. With a split KV cache llama.cpp clears
        the destination's stream and copies the source's at the start of the next decode; a unified one
        shares the cells (its destination is cleared first, since there the copy adds to what it holds)."""
        dst = run.session.seq_id
        ll.llama_memory_seq_rm(self._mem, dst, -1, -1)
        ll.llama_memory_seq_cp(self._mem, source.seq_id, dst, -1, -1)
        run.session.tokens[:] = source.tokens
        run.copied = True
        self._copied.add(dst)

    def _put_back(self, carried: list[tuple[_Running, int | None, int, list[int]]]) -> None:
        """After a cut step: each sequence it carried holds its cells from before it (llama.cpp removed the
        cut ubatch's, these are the ubatches' before it), its next token and its prompt's rest as before."""
        for run, token, length, todo in carried:
            ll.llama_memory_seq_rm(self._mem, run.session.seq_id, length, -1)
            del run.session.tokens[length:]
            run.next_token, run.todo = token, todo

    def _add_generated(self, rows: list[_Running], touched: set[TokenChannel[StreamItem]], sit_out: bool) -> int:
        """Puts each running sequence's last generated token in the batch (one row each), after
        ending the cancelled, the timed-out and those whose consumer stopped reading; the rows added."""
        now, endings = self._clock(), self._endings
        tokens: list[int] = []
        positions: list[int] = []
        sequences: list[int] = []
        for run in list(self._running):
            if run.ended:
                continue  # ended with another choice of its request, earlier in this loop
            ended = endings.interrupted(run, now)
            if ended is not None:
                self._end(run, ended, touched)
                continue
            if run.next_token is None or (sit_out and run.job.request.priority == "batch"):
                continue  # still prefilling, or a batch request sitting this step out
            ready = endings.consumer(run, now)
            if ready is not True:
                if ready is not False:
                    self._end(run, ready, touched)
                continue
            session = run.session
            tokens.append(run.next_token)
            positions.append(len(session.tokens))
            sequences.append(session.seq_id)
            session.tokens.append(run.next_token)
            run.next_token = None
            rows.append(run)
        self._rows.put(0, tokens, positions, sequences)
        return len(tokens)

    def _add_prompts(self, n: int, rows: list[_Running], scored: list[tuple[int, _Running, int]],
                     sit_out: bool = False) -> tuple[int, int]:
        """Fills the rest of the batch, from row `n`, with prompt chunks; (rows in the batch, sequences
        prefilling). In the line's order (worker/engine/line.py: the tenant with the fewest sequences
        decoding here for its weight first, then the shortest remaining prompt, then the oldest): a prompt
        whose prefix was cached has a few tokens left and gets its first token in this step, not after a
        long cold prompt's chunks. The prompts that finish in this step go in; a longer prompt takes what they leave of
        the chunk only when the rows that decode (now or from the next step) are owed no time
        (worker/engine/pacing.py). A prompt being scored goes SCORE_CHUNK tokens at a time, every row
        asking for logits (noted in `scored`)."""
        budget = min(self.config.prefill_chunk, self._n_batch - n)
        decoding, sequences, finishing = n, 0, 0
        for run in prefill_order(self._running):
            if budget <= 0:
                break
            if sit_out and run.job.request.priority == "batch":
                continue  # a batch request sitting this step out
            room = budget if run.scores is None else min(budget, SCORE_CHUNK)
            if len(run.todo) > room and not self.pace.admits(decoding + finishing):
                continue  # a shorter prompt may follow (another tenant's, later in the line)
            chunk, run.todo = run.todo[:room], run.todo[room:]
            sequences += 1
            finishing += not run.todo
            session, scoring = run.session, run.scores is not None
            start = len(session.tokens)
            self._rows.put_chunk(n, chunk, start, session.seq_id, all_logits=scoring, last_logits=not run.todo)
            if scoring:  # every row but the prompt's last is scored (that one is sampled)
                for position in range(start, start + len(chunk) - (not run.todo)):
                    scored.append((len(rows) + len(scored), run, position))
            if not run.todo:
                rows.append(run)
            session.tokens.extend(chunk)
            n += len(chunk)
            budget -= len(chunk)
        return n, sequences

    def _alternatives(self, run: _Running, row: np.ndarray) -> tuple[tuple[str, float], ...]:
        """The most likely tokens of this row, as text, for a request that asks for them."""
        return tuple((self.model.piece(t).decode("utf-8", errors="replace"), logprob)
                     for t, logprob in top_alternatives(row, run.job.request.alternatives))

    def _accept(self, run: _Running, token: int, probability: float, touched: set[TokenChannel[StreamItem]],
                alternatives: tuple[tuple[str, float], ...] = (), now: float | None = None,
                gaps: list[float] | None = None) -> None:
        model = self.model
        reason = self._endings.accept(run, model.piece(token), probability, touched, eog=model.is_eog(token),
                                      alternatives=alternatives, now=now, gaps=gaps, token=token)
        if run.generated == run.job.continued + 1:
            self._urgent = True  # its first token: the client's time to first token does not wait
        if reason is None:
            run.next_token = token
        else:
            self._end(run, self._endings.finished(run, reason), touched)

    def _end(self, run: _Running, outcome: Finished | Failed, touched: set[TokenChannel[StreamItem]]) -> None:
        """Ends one sequence; a failure ends its request's other choices too. Never one already in this
        step's batch: a failure comes from a check that all choices of a request share (the deadline,
        their one channel, which only gains room while a step runs), so the first of them the step
        looks at fails before any of them is put in the batch."""
        if run.ended:
            return
        self._running.remove(run)
        run.ended = True
        completed = self._endings.completed(run, outcome, touched)
        self._release(run.session, keep_kv=completed, clean=isinstance(outcome, Finished) and run.copied)
        self._endings.deliver(run, outcome, touched)
        for other in also_ending(run, outcome, self._running):
            self._end(other, outcome, touched)

    def _release(self, session: Session, *, keep_kv: bool, clean: bool = True) -> None:
        """`clean`: the cells hold exactly `session.tokens`; with a split KV they may then stay as a
        prompt cache for the next request on this id (no other sequence can use them anyway)."""
        assert self.table is not None, "Engine.bind(table) must be called before start()"
        seq_id = self.table.release(session, keep_kv=keep_kv, retain_cells=clean and self.config.prompt_cache
                                                                   and not self.config.kv_unified)
        if seq_id is not None:
            ll.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            session.tokens.clear()


class _BatchRows:
    """Numpy views onto a `llama_batch`'s per-row arrays, so that a step fills its rows with a few array
    writes instead of five ctypes stores a row. Each row's `seq_id` points into one array of ours (one
    sequence a row); `give_back` restores llama_batch_init's own pointers before llama_batch_free."""

    def __init__(self, batch: Any, n: int) -> None:
        self.token = np.ctypeslib.as_array(batch.token, shape=(n,))
        self.pos = np.ctypeslib.as_array(batch.pos, shape=(n,))
        self.logits = np.ctypeslib.as_array(batch.logits, shape=(n,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))[:] = 1
        self._seq_ids = (ctypes.c_int32 * n)()
        self.seq = np.ctypeslib.as_array(self._seq_ids)
        # The addresses themselves: an element read from batch.seq_id is a view of its slot, not a copy.
        self._given = [int(ctypes.cast(batch.seq_id[i], ctypes.c_void_p).value or 0) for i in range(n)]
        base, size = ctypes.addressof(self._seq_ids), ctypes.sizeof(ctypes.c_int32)
        for i in range(n):
            batch.seq_id[i] = ctypes.cast(base + i * size, ctypes.POINTER(ctypes.c_int32))

    def put(self, at: int, tokens: list[int], positions: list[int], seq_ids: list[int]) -> None:
        """Rows `at`.. : one generated token each, every one asking for logits."""
        end = at + len(tokens)
        self.token[at:end] = tokens
        self.pos[at:end] = positions
        self.seq[at:end] = seq_ids
        self.logits[at:end] = 1

    def put_chunk(self, at: int, tokens: list[int], start: int, seq_id: int, *, all_logits: bool,
                  last_logits: bool) -> None:
        """Rows `at`.. : a prompt chunk of one sequence from position `start`; logits for every row when
        `all_logits` (a scored prompt), else for the last one only when `last_logits` (the prompt's end)."""
        end = at + len(tokens)
        self.token[at:end] = tokens
        self.pos[at:end] = np.arange(start, start + len(tokens), dtype=np.int32)
        self.seq[at:end] = seq_id
        self.logits[at:end] = all_logits
        if last_logits:
            self.logits[end - 1] = 1

    def give_back(self, batch: Any) -> None:
        for i, address in enumerate(self._given):
            batch.seq_id[i] = ctypes.cast(address, ctypes.POINTER(ctypes.c_int32))


def _wake_all(channels: list[TokenChannel[StreamItem]]) -> None:
    for channel in channels:
        channel.wake()


def _read_cells(ctx: Any, seq_id: int) -> bytes:
    size = int(ll.llama_state_seq_get_size(ctx, ctypes.c_int32(seq_id)))
    buffer = (ctypes.c_uint8 * size)()
    written = int(ll.llama_state_seq_get_data(ctx, buffer, size, ctypes.c_int32(seq_id)))
    if written != size:
        raise RuntimeError(f"llama.cpp saved {written} of the sequence's {size} bytes")
    return ctypes.string_at(buffer, size)


def state_seq_size(seq_id: int) -> Callable[[Any], int]:
    """For `Engine.call`: llama.cpp's own byte size of one sequence's saved state."""
    return lambda ctx: int(ll.llama_state_seq_get_size(ctx, ctypes.c_int32(seq_id)))
