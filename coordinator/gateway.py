"""The one way in behind every public surface: the order of a request's steps, and nothing else.

Owns: that order, so every surface decides its status code before the first byte: the request's stages
(coordinator/stages/: its span, its priority class, its key's limits, its fair-share charge), resolve
the model (pool/models.py), answer from the response cache (cache.py), admit in turn (admission/),
lean on affinity (affinity/), rank (scheduling/), dispatch (relay/), and the single end of what was
admitted (stages/ending.py). Also what ties the steps together: the guard that gives a reservation
back when a step after dispatch fails. An embedding request (`embed`) takes the same steps but the
cache and affinity, with its own admission slots, queue and policy (it holds no sequence and no KV),
and one JSON answer for a relay.
Must not: know any public wire format. Surfaces (coordinator/surfaces/) parse their own requests into
a `Generation` and turn the relay's internal events (protocol.worker) into their own bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from coordinator.admission.demand import Demand
from coordinator.admission.turn import in_turn
from coordinator.auth import Client
from coordinator.cache import cache_key
from coordinator.embedding import Embedding
from coordinator.errors import CoordinatorError
from coordinator.generation import Generation
from coordinator.placement import Placed, Placement
from coordinator.pool.models import resolve_model, stand_in
from coordinator.relay.dispatch import OpenStream
from coordinator.relay.embeddings import EmbedAnswer
from coordinator.relay.supervisor import Ending
from coordinator.scheduling import Request
from coordinator.stages import End, Entry, Passage, Stages, W, ending
from coordinator.stages.ending import Opened
from coordinator.stages.fair_charge import FairCharge
from coordinator.stages.key_limits import KeyLimitStage
from coordinator.stages.priority_class import PriorityClass
from coordinator.stages.span import Span
from protocol import reasons
from serving.tracing import NO_TRACE, Trace

if TYPE_CHECKING:
    from pydantic import BaseModel

    from coordinator.state import CoordinatorState
    from coordinator.tokenizing import Tokenized

# What an embedding request asks of the generation side: nothing (the scheduler's `Request` needs one).
EMBEDDING_DEMAND = Demand(prompt_bytes=0, max_tokens=0, new_session=False)


class Gateway:
    def __init__(self, state: CoordinatorState) -> None:
        self._state = state
        self._placement = Placement(state)
        # The stages each kind of request passes, in the order it enters them (coordinator/stages/).
        self._generations: Stages[Generation] = Stages([
            Span(state.tracing), PriorityClass(), KeyLimitStage(state.limits),
            FairCharge(state.fair, headroom=state.settings.fair_share and state.api_keys is not None)])
        self._embeddings: Stages[Embedding] = Stages([Span(state.tracing), KeyLimitStage(state.limits)])

    def now(self) -> float:
        return self._state.clock.monotonic()

    def refused(self, request_id: str, exc: CoordinatorError, started: float, *, surface: str,
                tenant: str | None = None) -> None:
        """Count and log a request refused before its first byte (a surface's parse errors too); a
        generation's also for its tenant."""
        self._state.requests.refused(request_id, exc, started, surface=surface, tenant=tenant)

    async def open(self, gen: Generation, started: float, *,
                   client_gone: Callable[[], Awaitable[None]] | None = None, client: Client | None = None,
                   headers: Mapping[str, str] | None = None) -> Opened:
        """Admit (waiting in the queue while capacity is short), schedule and dispatch; raises a
        `CoordinatorError` (already counted and logged). `client_gone` returns when the client has
        disconnected, so a request waiting in the queue leaves it at once. `client`: the API key that
        let it in. `headers`: the client's, whose `traceparent` the request's span continues. The
        request passes its stages (`self._generations`) around these steps, and leaves them when its
        response ends (`Opened.finish`)."""
        passage = self._entered(self._generations, gen, started, client, headers, tenant=gen.request.tenant)
        try:
            opened = await self._open(passage.work, started, client_gone, passage.entry)
        except BaseException as exc:
            passage.failed(exc)
            raise
        finish = opened.finish

        def finished(ending: Ending) -> None:
            try:
                finish(ending)
            finally:
                passage.ended(opened.end())

        opened.finish = finished
        return opened

    def _entered(self, stages: Stages[W], work: W, started: float, client: Client | None,
                 headers: Mapping[str, str] | None, *, tenant: str | None = None) -> Passage[W]:
        """`work` let in by its stages, or their refusal, counted and logged."""
        try:
            return stages.enter(work, client, headers)
        except CoordinatorError as exc:
            self.refused(work.request_id, exc, started, surface=work.surface, tenant=tenant)
            raise

    async def _open(self, gen: Generation, started: float, client_gone: Callable[[], Awaitable[None]] | None,
                    entry: Entry[Generation]) -> Opened:
        """Placed in turn: in its model's line of the queue while it waits, for capacity, for its model to
        load or for a swap to end (`_waits`), woken by releases and heartbeats."""
        state = self._state
        tenant = gen.request.tenant
        with state.requests.accounted("open", gen.request_id, started, surface=gen.surface, tenant=tenant):
            self._check_own_limits()
            line = state.waiting.line(gen.request.model)
            if not state.queue.enabled() or line is None:
                return await self._try(gen, started, entry, None)
            waiting = gen.trace.child("queue")
            return await in_turn(state.queue, line, lambda placed: self._try(gen, started, entry, placed, waiting),
                                 started=started, now=self.now, metrics=state.metrics, client_gone=client_gone,
                                 tenant=tenant, rank=entry.rank, waits=state.waiting.waits(line))

    async def _try(self, gen: Generation, started: float, entry: Entry[Generation], placed: Placed,
                   waiting: Trace = NO_TRACE) -> Opened:
        """One try: its model loaded (or asked for), resolved, the response cache, then placement; the
        relay of the worker's stream, or a refusal."""
        state = self._state
        await state.waiting.loaded(gen.request.model)
        gen, model = self._resolved(gen)
        identity = state.registry.identity_of(model) if model is not None else ""
        key = cache_key(gen.surface, model, gen.request, identity) if state.cache.enabled else None
        if key is not None:
            hit = state.cache.get(key)
            state.metrics.cache_lookups.labels(outcome="hit" if hit else "miss").inc()
            if hit is not None:  # answered at once: nothing admitted, reserved or computed
                waiting.end()
                return ending.replayed(state, gen, model, hit, started)
        resume, session = None, gen.session_key
        why_not = gen.not_continued(session_held=session is not None and state.sessions.worker_of(session) is not None)
        if not why_not and state.settings.continuations:
            gen = gen.tracked()
            resume = functools.partial(self._placement.resume, gen, model, entry.rank)
        gen, stream = await self._admit(gen, model, placed, waiting)
        try:
            return ending.relayed(state, gen, model, stream, (key, identity) if key is not None else None,
                                  started, entry.on_token, resume, not_continued=why_not)
        except BaseException:
            state.admission.release(stream.reservation)
            await stream.close()  # the worker cancels the request and frees its sequence
            raise

    async def embed(self, work: Embedding, started: float, *,
                    client_gone: Callable[[], Awaitable[None]] | None = None, client: Client | None = None,
                    headers: Mapping[str, str] | None = None) -> EmbedAnswer:
        """Admit (waiting in the embedding queue while every slot is taken), schedule and dispatch an
        embedding request; its answer, or a `CoordinatorError` (already counted and logged). It passes
        its stages (`self._embeddings`: its span, its key's limits) as a generation does."""
        passage = self._entered(self._embeddings, work, started, client, headers)
        try:
            answer = await self._embed_admitted(passage.work, started, client_gone)
        except BaseException as exc:
            passage.failed(exc)
            raise
        response = answer.response
        passage.ended(End(response.worker_id, response.model, prompt_tokens=sum(response.prompt_tokens),
                          attributes={"llm_pool.inputs": len(response.embeddings),
                                      "llm_pool.attempts": answer.attempts}))
        return answer

    async def _embed_admitted(self, work: Embedding, started: float,
                              client_gone: Callable[[], Awaitable[None]] | None) -> EmbedAnswer:
        state = self._state
        with state.requests.accounted("embed", work.request_id, started, surface=work.surface):
            self._check_own_limits(relayed=False)
            work, model = self._resolved(work)
            if state.embedding_queue.enabled() and model is not None:
                waiting = work.trace.child("queue")
                answer = await in_turn(state.embedding_queue, model,
                                       lambda placed: self._embed(work, model, placed, waiting),
                                       started=started, now=self.now, metrics=state.metrics,
                                       client_gone=client_gone)
            else:
                answer = await self._embed(work, model, None)
        response = answer.response
        state.requests.embedded(work.request_id, work.surface, worker_id=response.worker_id, model=response.model,
                                inputs=len(response.embeddings), tokens=sum(response.prompt_tokens),
                                attempts=answer.attempts, started=started, trace_id=work.trace.trace_id)
        return answer

    async def _embed(self, work: Embedding, model: str | None, placed: Placed, waiting: Trace = NO_TRACE
                     ) -> EmbedAnswer:
        """One placement attempt: admission's check, the embedding policy's ranking, then dispatch.
        `waiting`: the span of its wait in the queue, which ends here."""
        waiting.end()
        state = self._state
        with work.trace.step("placement"):
            state.embedding_admission.check(model)
            decision = state.embedding_policy.select(
                Request(EMBEDDING_DEMAND, model, turn=next(state.turns), rng=state.rng),
                state.registry.alive(model), now=state.clock.monotonic())
        if decision.reason is not None:
            raise CoordinatorError(decision.reason, f"no worker can take it now: {decision.reason}",
                                   retry_after=state.settings.retry_after)
        ranked = [w for w in (state.registry.get(v.worker_id) for v in decision.ranked) if w is not None]
        wanted = work.request.dimensions
        served = ranked[0].embeddings if ranked else None
        if wanted is not None and served is not None and served.dimensions != wanted:
            raise CoordinatorError(reasons.INVALID_REQUEST, f"dimensions: {model} embeds into {served.dimensions} "
                                   "dimensions, the only size served", param="dimensions")
        return await state.embedder.embed(work, ranked, reserved=placed)

    def _resolved(self, work: W) -> tuple[W, str | None]:
        """The served model a request means (pool/models.py), and the request naming it when the pool took
        a name for it."""
        state = self._state
        model = resolve_model(state.registry, state.settings.default_model, work.request.model,
                              any_name=state.settings.any_model_name)
        name = stand_in(state.registry, work.request.model, model)
        return (work.for_model(name) if name is not None else work), model

    def _check_own_limits(self, *, relayed: bool = True) -> None:
        """Not while it drains; and, for a request it would relay (`relayed`), the process's own limit:
        past `max_streams` relayed at once, one more would slow them all."""
        state = self._state
        if state.draining:
            raise CoordinatorError(reasons.DRAINING, "the coordinator is shutting down; try another",
                                   retry_after=state.settings.retry_after)
        if relayed and len(state.streams) >= state.settings.max_streams:
            raise CoordinatorError(reasons.STREAMS_FULL, f"this coordinator is relaying {len(state.streams)} "
                                   "streams, its limit", retry_after=state.settings.retry_after)

    async def _admit(self, gen: Generation, model: str | None, placed: Placed, waiting: Trace = NO_TRACE
                     ) -> tuple[Generation, OpenStream]:
        """One placement attempt; `placed` runs once a worker's capacity is reserved for it, before that
        worker answers. A new session's first turn holds a claim on its id meanwhile. `waiting`: the span
        of its wait in the queue, which ends here (a second call finds it ended)."""
        waiting.end()
        state = self._state
        self._check_own_limits()  # also for a request that waited in the queue
        key = gen.session_key
        if key is None or state.sessions.worker_of(key) is not None:
            return await self._placement.place(gen, model, placed)
        # A first turn: one at a time per id, or two workers would each start the conversation.
        if not state.sessions.claim(key):
            raise CoordinatorError(reasons.SESSION_BUSY, f"session {gen.request.session_id!r} is starting on "
                                   "another request; send turns one at a time")
        try:
            return await self._placement.place(gen, model, placed)
        finally:
            state.sessions.unclaim(key)

    async def tokenize(self, path: str, model: str | None, work: BaseModel, answer: type[BaseModel],
                       request_id: str) -> Tokenized:
        """A tokenizer request (/tokenize, /detokenize, /tokenizer_info): none of the steps above, as it
        holds no sequence and no KV; coordinator/tokenizing.py chooses the model's workers and tries them."""
        return await self._state.tokenizing.ask(path, model, work, answer, request_id)
