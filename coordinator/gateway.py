"""The one way in behind every public surface: the order of a request's steps, and nothing else.

Owns: that order, so every surface decides its status code before the first byte: resolve the model
(pool/models.py), answer from the response cache (cache.py), admit in turn (admission/), lean on
affinity (affinity/), rank (scheduling/), dispatch and relay (relay/), and account for the request
however it ends (relay/requests.py). Also what ties the steps together: the reservation a request
holds from dispatch to its final event, and the guard that gives it back when a step after dispatch
fails. An embedding request (`embed`) takes the same steps but the cache and affinity, with its own
admission slots, queue and policy (it holds no sequence and no KV), and one JSON answer for a relay.
Must not: know any public wire format. Surfaces (coordinator/surfaces/) parse their own requests into
a `Generation` and turn the relay's internal events (protocol.worker) into their own bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.admission import priority
from coordinator.admission.demand import Demand
from coordinator.admission.turn import in_turn
from coordinator.affinity.placement import Leaning
from coordinator.auth import Client, KeyLimits
from coordinator.cache import Replay, cache_key
from coordinator.embedding import Embedding
from coordinator.errors import CoordinatorError
from coordinator.generation import Generation
from coordinator.metrics import tenant_label
from coordinator.pool.loads import serving
from coordinator.pool.models import resolve_model, stand_in
from coordinator.pool.registry import ALIVE, WorkerRecord
from coordinator.relay.dispatch import OpenStream, PrefixHints, PrefixPeer
from coordinator.relay.embeddings import EmbedAnswer
from coordinator.relay.prefill import prefill_on
from coordinator.relay.stream import Outcome, Relay
from coordinator.relay.supervisor import Ending
from coordinator.scheduling import Request
from protocol import reasons
from protocol.sse import SseEvent
from serving import tracing
from serving.tracing import NO_TRACE, Trace

if TYPE_CHECKING:
    from pydantic import BaseModel

    from coordinator.state import CoordinatorState
    from coordinator.tokenizing import Tokenized

# What an embedding request asks of the generation side: nothing (the scheduler's `Request` needs one).
EMBEDDING_DEMAND = Demand(prompt_bytes=0, max_tokens=0, new_session=False)
# A stream that ended with one of these counts against its worker's circuit breaker.
WORKER_FAULTS = frozenset({reasons.WORKER_FAILED, reasons.ENGINE_FAILED})
# Refusals for want of a worker that a model swap under way explains (the request waits and tries again).
SWAP_REFUSALS = frozenset({reasons.MODEL_SWAPPING, reasons.DRAINING, reasons.NO_WORKERS, reasons.MODEL_UNAVAILABLE,
                           reasons.UNKNOWN_MODEL})
SWAP_RETRIES = 100  # tries after the first; with SWAP_PAUSE, past any swap the queue's timeout allows
SWAP_PAUSE = 0.2  # seconds between them
Placed = Callable[[], None] | None
CACHE_HIT = "cache"  # an `Opened`'s worker id when the response cache answered
NO_LIMITS = KeyLimits()  # a request without an API key: no limits, every class


@dataclass(slots=True)
class Opened:
    """An admitted request whose worker has sent its first event: the surface streams `relay`."""

    relay: Relay
    worker_id: str
    model: str
    finish: Callable[[Ending], None]  # call exactly once, when the client's response has ended


def _ended(trace: Trace, outcome: Outcome) -> None:
    """The request's span, ended with how its stream ended."""
    if trace is NO_TRACE:
        return
    if outcome.done is not None:
        trace.set({"llm_pool.finish_reason": outcome.done.finish_reason,
                   "llm_pool.prompt_tokens": outcome.done.usage.prompt_tokens,
                   "llm_pool.completion_tokens": outcome.done.usage.completion_tokens})
    else:
        trace.set({"llm_pool.tokens_relayed": outcome.tokens})
        trace.fail(outcome.error_reason or "cut")
    trace.end()


def _usage(opened: Opened) -> tuple[int, int]:
    """What a finished request used, (prompt, generated) tokens: as its usage says, or the tokens
    relayed when it ended without one; nothing for a cached answer."""
    if opened.worker_id == CACHE_HIT:
        return 0, 0
    outcome = opened.relay.outcome
    if outcome.done is not None:
        return outcome.done.usage.prompt_tokens, outcome.done.usage.completion_tokens
    return 0, outcome.tokens


class Gateway:
    def __init__(self, state: CoordinatorState) -> None:
        self._state = state

    def now(self) -> float:
        return self._state.clock.monotonic()

    def refused(self, request_id: str, exc: CoordinatorError, started: float, *, surface: str,
                tenant: str | None = None) -> None:
        """Count and log a request refused before its first byte (a surface's parse errors too); a
        generation's also for its tenant."""
        self._state.requests.refused(request_id, exc, started, surface=surface)
        if tenant is not None:
            self._state.metrics.tenant_refusals.labels(tenant=tenant_label(tenant), reason=exc.reason).inc()

    async def open(self, gen: Generation, started: float, *,
                   client_gone: Callable[[], Awaitable[None]] | None = None, client: Client | None = None,
                   headers: Mapping[str, str] | None = None) -> Opened:
        """Admit (waiting in the queue while capacity is short), schedule and dispatch; raises a
        `CoordinatorError` (already counted and logged). `client_gone` returns when the client has
        disconnected, so a request waiting in the queue leaves it at once. `client`: the API key that
        let it in, held to its limits (admission/limits.py). From here until its response ends, the
        request's tenant is active for fair shares (admission/fairness.py). `headers`: the client's,
        whose `traceparent` the request's span continues when this coordinator traces."""
        state, tenant = self._state, gen.request.tenant
        key = client.limits if client is not None else NO_LIMITS
        trace = tracing.begin(state.tracing, f"{gen.surface} request", headers or {}, {
            "llm_pool.request_id": gen.request_id, "llm_pool.surface": gen.surface, "llm_pool.tenant": tenant,
            "llm_pool.model": gen.request.model or ""})
        if trace is not NO_TRACE:  # an untraced request is not copied for it
            gen = dataclasses.replace(gen, trace=trace)
        try:
            rank = priority.resolve(gen.priority, key.priority, key.max_priority)
            gen = gen.classed(priority.CLASSES[rank])
            trace.set({"llm_pool.priority": priority.CLASSES[rank]})
            if client is not None:
                state.limits.admit(client.key_id, key)
        except CoordinatorError as exc:
            self.refused(gen.request_id, exc, started, surface=gen.surface, tenant=tenant)
            trace.fail(exc.reason)
            trace.end()
            raise
        state.fair.arrive(tenant)
        try:
            opened = await self._open(gen, started, client_gone, rank)
        except BaseException as exc:
            state.fair.depart(tenant)
            if client is not None:
                state.limits.finished(client.key_id, client.limits, 0)
            trace.raised(exc)
            trace.end()
            raise
        finish = opened.finish
        trace.set({"llm_pool.worker": opened.worker_id, "llm_pool.model": opened.model})

        def finished(ending: Ending) -> None:
            try:
                finish(ending)
            finally:
                _ended(trace, opened.relay.outcome)
                prompt, generated = _usage(opened)
                state.fair.depart(tenant)
                state.fair.ended(opened.worker_id, tenant, prompt, generated)  # the worker reports it too
                if client is not None:
                    state.limits.finished(client.key_id, client.limits, prompt + generated)

        opened.finish = finished
        return opened

    async def _open(self, gen: Generation, started: float, client_gone: Callable[[], Awaitable[None]] | None,
                    rank: int) -> Opened:
        state = self._state
        try:
            self._check_own_limits()
            for attempt in itertools.count():
                await self._until_loaded(gen.request.model, started)
                try:
                    model = resolve_model(state.registry, state.settings.default_model, gen.request.model,
                                          any_name=state.settings.any_model_name)
                    if (name := stand_in(state.registry, gen.request.model, model)) is not None:
                        gen = gen.for_model(name)
                    identity = state.registry.identity_of(model) if model is not None else ""
                    key = cache_key(gen.surface, model, gen.request, identity) if state.cache.enabled else None
                    if key is not None:
                        hit = state.cache.get(key)
                        state.metrics.cache_lookups.labels(outcome="hit" if hit else "miss").inc()
                        if hit is not None:  # answered at once: nothing admitted, reserved or computed
                            return self._replay(gen, model, hit, started)
                    gen, stream = await self._admitted(gen, model, started, client_gone, rank)
                    break
                except CoordinatorError as refused:
                    await self._through_swap(refused, gen.request.model, started, attempt)
            try:
                return self._opened(gen, model, stream, (key, identity) if key is not None else None, started)
            except BaseException:
                state.admission.release(stream.reservation)
                await stream.close()  # the worker cancels the request and frees its sequence
                raise
        except CoordinatorError as exc:
            self.refused(gen.request_id, exc, started, surface=gen.surface, tenant=gen.request.tenant)
            raise
        except Exception as exc:  # a bug before the first byte: the client gets a 500 naming no detail
            state.log.error(json.dumps({"event": "internal_error", "task": "open", "request_id": gen.request_id,
                                        "error": repr(exc)}), exc_info=exc)
            state.metrics.internal_errors.labels(task="open").inc()
            internal = CoordinatorError(reasons.INTERNAL, "internal error")
            self.refused(gen.request_id, internal, started, surface=gen.surface, tenant=gen.request.tenant)
            raise internal from None

    async def embed(self, work: Embedding, started: float, *,
                    client_gone: Callable[[], Awaitable[None]] | None = None,
                    headers: Mapping[str, str] | None = None) -> EmbedAnswer:
        """Admit (waiting in the embedding queue while every slot is taken), schedule and dispatch an
        embedding request; its answer, or a `CoordinatorError` (already counted and logged). `headers`:
        the client's, whose `traceparent` the request's span continues when this coordinator traces."""
        trace = tracing.begin(self._state.tracing, f"{work.surface} request", headers or {}, {
            "llm_pool.request_id": work.request_id, "llm_pool.surface": work.surface,
            "llm_pool.tenant": work.request.tenant, "llm_pool.model": work.request.model or ""})
        if trace is not NO_TRACE:  # an untraced request is not copied for it
            work = dataclasses.replace(work, trace=trace)
        try:
            answer = await self._embed_admitted(work, started, client_gone)
        except BaseException as exc:
            trace.raised(exc)
            trace.end()
            raise
        trace.set({"llm_pool.worker": answer.response.worker_id, "llm_pool.model": answer.response.model,
                   "llm_pool.inputs": len(answer.response.embeddings), "llm_pool.attempts": answer.attempts})
        trace.end()
        return answer

    async def _embed_admitted(self, work: Embedding, started: float,
                              client_gone: Callable[[], Awaitable[None]] | None) -> EmbedAnswer:
        state = self._state
        try:
            if state.draining:
                raise CoordinatorError(reasons.DRAINING, "the coordinator is shutting down; try another",
                                       retry_after=state.settings.retry_after)
            model = resolve_model(state.registry, state.settings.default_model, work.request.model,
                                  any_name=state.settings.any_model_name)
            if (name := stand_in(state.registry, work.request.model, model)) is not None:
                work = work.for_model(name)
            if state.embedding_queue.enabled() and model is not None:
                waiting = work.trace.child("queue")
                answer = await in_turn(state.embedding_queue, model,
                                       lambda placed: self._embed(work, model, placed, waiting),
                                       started=started, now=self.now, metrics=state.metrics,
                                       client_gone=client_gone)
            else:
                answer = await self._embed(work, model, None)
        except CoordinatorError as exc:
            self.refused(work.request_id, exc, started, surface=work.surface)
            raise
        except Exception as exc:  # a bug: the client gets a 500 naming no detail
            state.log.error(json.dumps({"event": "internal_error", "task": "embed", "request_id": work.request_id,
                                        "error": repr(exc)}), exc_info=exc)
            state.metrics.internal_errors.labels(task="embed").inc()
            internal = CoordinatorError(reasons.INTERNAL, "internal error")
            self.refused(work.request_id, internal, started, surface=work.surface)
            raise internal from None
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

    async def _admitted(self, gen: Generation, model: str | None, started: float,
                        client_gone: Callable[[], Awaitable[None]] | None, rank: int) -> tuple[Generation, OpenStream]:
        """Admitted and placed, through the queue when it is on."""
        state = self._state
        if state.queue.enabled() and model is not None:
            waiting = gen.trace.child("queue")
            return await in_turn(state.queue, model, lambda placed: self._admit(gen, model, placed, waiting),
                                 started=started, now=self.now, metrics=state.metrics, client_gone=client_gone,
                                 tenant=gen.request.tenant, rank=rank)
        return await self._admit(gen, model, None)

    async def _through_swap(self, refused: CoordinatorError, requested: str | None, started: float,
                            attempt: int) -> None:
        """Returns when a request refused for want of a worker should try again, after SWAP_PAUSE: a
        worker swaps to its model or away from it (the worker's refusal says so, 503 `model_swapping`,
        or its heartbeats do). Raises `refused` otherwise, or `queue_timeout` once the queue's deadline
        would pass, or SWAP_RETRIES tries have been made. A request placed the moment before a swap
        began meets its drain; one for a model swapped away finds no undrained worker."""
        state = self._state
        if refused.reason not in SWAP_REFUSALS or requested is None:
            raise refused
        model = state.registry.resolve(requested) or state.registry.offered_as(requested) or requested
        if refused.reason != reasons.MODEL_SWAPPING and not state.registry.swap_involves(model):
            raise refused
        if attempt >= SWAP_RETRIES or self.now() + SWAP_PAUSE >= started + state.settings.queue_timeout:
            raise CoordinatorError(reasons.QUEUE_TIMEOUT, f"model {requested!r}: the swap under way did not end "
                                   "within the queue's timeout", retry_after=state.settings.retry_after)
        await asyncio.sleep(SWAP_PAUSE)

    async def _until_loaded(self, requested: str | None, started: float) -> None:
        """A model a worker offers from its folder but none serves: one worker loads it (pool/loads.py),
        and the request waits for it within the queue's timeout."""
        state = self._state
        if requested is None:  # the model it would get: the default, or the only one (standby workers' too)
            requested = resolve_model(state.registry, state.settings.default_model, None)
        if requested is None or not state.settings.model_loads:
            return
        named = state.registry.resolve(requested)  # O(1): a served model's name or alias ends it here
        if named is not None and serving(state.registry, named):
            return
        offered = state.registry.offered_as(requested)  # the workers' offers, only for a model none serves
        if offered is not None and named in (None, offered):
            await state.loads.until_served(offered, started + state.settings.queue_timeout)

    def _check_own_limits(self) -> None:
        """Also the process's own limit: past `max_streams` relayed at once, one more would slow them all."""
        state = self._state
        if state.draining:
            raise CoordinatorError(reasons.DRAINING, "the coordinator is shutting down; try another",
                                   retry_after=state.settings.retry_after)
        if len(state.streams) >= state.settings.max_streams:
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
            return await self._place(gen, model, placed)
        # A first turn: one at a time per id, or two workers would each start the conversation.
        if not state.sessions.claim(key):
            raise CoordinatorError(reasons.SESSION_BUSY, f"session {gen.request.session_id!r} is starting on "
                                   "another request; send turns one at a time")
        try:
            return await self._place(gen, model, placed)
        finally:
            state.sessions.unclaim(key)

    async def _place(self, gen: Generation, model: str | None, placed: Placed) -> tuple[Generation, OpenStream]:
        """Admission's check, affinity's leaning, the scheduler's ranking, then dispatch in that order."""
        state, body = self._state, gen.request
        affinity = state.affinity
        if affinity.session_worker(gen) is not None:
            # It continues a conversation: the worker already holds its sequence slot.
            gen = dataclasses.replace(gen, demand=dataclasses.replace(gen.demand, new_session=False))
        with gen.trace.step("placement"):  # admission's check, affinity and the policy's ranking
            state.admission.check(gen.demand, model, body.tenant)
            leaning = affinity.lean(gen, model, by_prefix=state.policy.uses("prefix"))
            decision = state.policy.select(
                Request(gen.demand, model, body.session_id, leaning.session_worker, leaning.prefer,
                        prefix_match=leaning.match, turn=next(state.turns), rng=state.rng),
                leaning.candidates, now=state.clock.monotonic())
        if decision.reason == reasons.UNKNOWN_SESSION:
            affinity.lost(gen.session_key)
            raise CoordinatorError(reasons.UNKNOWN_SESSION,
                                   f"session {body.session_id!r} lived on a worker that is gone; start a new one")
        if decision.reason is not None:
            raise CoordinatorError(decision.reason, f"no worker can take it now: {decision.reason}",
                                   retry_after=state.settings.retry_after)
        ranked = [w for w in (state.registry.get(v.worker_id) for v in decision.ranked) if w is not None]
        peer = self._prefix_peer(leaning)
        if self._disaggregated(gen, ranked):
            # Prefill on the policy's first worker, decode on the others; without a finished prefill
            # the request goes to all of them as usual.
            first_placed, placed = placed, None  # the prefill runs with its own reservation

            def opens(part: Generation, workers: Sequence[WorkerRecord]) -> Awaitable[OpenStream]:
                return state.attempts.open(part, workers, reserved=first_placed)

            prefilled = await prefill_on(ranked[0], gen, opens, state.attempts.release,
                                         read_timeout=state.settings.worker_read_timeout)
            state.metrics.prefills.labels(outcome="failed" if prefilled is None else "prefilled").inc()
            if prefilled is not None:
                ranked, peer = ranked[1:], prefilled
        try:
            stream = await state.attempts.open(gen, ranked, reserved=placed,
                                                 hints=PrefixHints.of(leaning.hashes, peer))
        except CoordinatorError as exc:
            if exc.reason in (reasons.SESSION_EXPIRED, reasons.UNKNOWN_SESSION):
                affinity.lost(gen.session_key)
            raise
        affinity.placed(gen, model, stream.worker.worker_id, leaning)
        return gen, stream

    def _disaggregated(self, gen: Generation, ranked: list[WorkerRecord]) -> bool:
        """Whether this request is prefilled on one worker and decoded on another (DISAGGREGATE_PROMPT_BYTES):
        a new one-shot request with a long prompt, and two workers to do it."""
        threshold = self._state.settings.disaggregate_prompt_bytes
        return (threshold > 0 and gen.demand.prompt_bytes >= threshold and gen.request.session_id is None
                and gen.request.n == 1 and len(ranked) >= 2)

    def _prefix_peer(self, leaning: Leaning) -> PrefixPeer | None:
        """The alive worker that was sent most of this prompt's prefix, if any was: another worker the
        request goes to may fetch those cells from it instead of prefilling them (issue 19)."""
        if not leaning.match:
            return None
        worker_id, share = max(leaning.match.items(), key=lambda item: item[1])
        record = self._state.registry.get(worker_id)
        if record is None or record.state != ALIVE or record.draining:
            return None
        return PrefixPeer(worker_id, record.url, share, leaning.match)

    def _opened(self, gen: Generation, model: str | None, stream: OpenStream, cached: tuple[bytes, str] | None,
                started: float) -> Opened:
        """The relay of a request whose worker has sent its first event, with its final callback."""
        state = self._state
        session_id = gen.request.session_id
        reservation, admission = stream.reservation, state.admission
        breakers, worker_id, cache = state.breakers, stream.worker.worker_id, state.cache
        fair, tenant = state.fair, gen.request.tenant
        generated = state.metrics.tenant_tokens.labels(tenant=tenant_label(tenant), kind="generated")

        def release(outcome: Outcome) -> None:
            """The reservation back (a second call does nothing); a named session that ended `done`
            stays counted as kept, with all its tokens, until the worker's heartbeat says otherwise."""
            done = outcome.done
            admission.release(reservation, kept_tokens=done.usage.total_tokens
                              if session_id is not None and done is not None else None)

        def final(outcome: Outcome) -> None:
            release(outcome)
            done = outcome.done
            # A token event may carry several tokens (a character split across them): the rest now.
            made = max(done.usage.completion_tokens, outcome.tokens) if done is not None else outcome.tokens
            if made > outcome.tokens:
                fair.charge_output(tenant, made - outcome.tokens)
            generated.inc(made)
            if done is not None:
                breakers.succeeded(worker_id)
                if cached is not None and relay.record is not None and done.finish_reason != "cancelled":
                    key, identity = cached
                    cache.put(key, tuple(relay.record), identity)  # complete streams only
            elif outcome.error_reason in WORKER_FAULTS:
                breakers.failed(worker_id)
            else:
                breakers.settled(worker_id)  # the client left, or read too slowly: no verdict

        settings = state.settings
        # Each token event is charged to the tenant's fair share as it comes, not at the end.
        relay = Relay(stream, request_id=gen.request_id, buffer_events=settings.relay_buffer_events,
                      write_deadline=settings.relay_write_deadline, metrics=state.metrics, on_final=final,
                      record_bytes=cache.entry_limit if cached is not None else 0,
                      on_token=functools.partial(fair.charge_output, tenant))
        state.streams.add(relay)
        try:
            state.metrics.admitted()
            state.metrics.requests_running.inc()
        except BaseException:
            state.streams.discard(relay)  # open() gives the reservation back and closes the worker request
            raise
        # Only these outlive this call: not the parsed request, nor its prompt.
        surface, trace_id = gen.surface, gen.trace.trace_id

        def finish(ending: Ending) -> None:
            """Runs once per admitted request, whatever the ending: release, count, log."""
            state.streams.discard(relay)
            release(relay.outcome)  # done already, unless cut short
            state.requests.finished(relay.request_id, surface, stream, relay.outcome, ending, started, trace_id)

        return Opened(relay, worker_id, model or stream.worker.model, finish)

    def _replay(self, gen: Generation, model: str | None, events: tuple[SseEvent, ...], started: float) -> Opened:
        """A cache hit: the recorded stream through the same relay and response as a live one."""
        state, settings = self._state, self._state.settings
        relay = Relay(Replay(events, gen.request_id), request_id=gen.request_id,
                      buffer_events=settings.relay_buffer_events, write_deadline=settings.relay_write_deadline,
                      metrics=state.metrics)
        surface = gen.surface
        return Opened(relay, CACHE_HIT, model or "",
                      lambda ending: state.requests.replayed(relay.request_id, surface, relay.outcome, ending, started))

    async def tokenize(self, path: str, model: str | None, work: BaseModel, answer: type[BaseModel],
                       request_id: str) -> Tokenized:
        """A tokenizer request (/tokenize, /detokenize, /tokenizer_info): none of the steps above, as it
        holds no sequence and no KV; coordinator/tokenizing.py chooses the model's workers and tries them."""
        return await self._state.tokenizing.ask(path, model, work, answer, request_id)
