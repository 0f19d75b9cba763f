"""The one way in behind every public surface: resolve the model, admit, schedule, dispatch, relay,
and account for the request however it ends.

Owns: the order of those steps (so every surface decides its status code before the first byte),
model resolution (a name or alias, the configured default, the only model), session affinity and
conversation-prefix bookkeeping, and the one structured log line and metrics per request.
Must not: know any public wire format. Surfaces (coordinator/surfaces/) parse their own requests into
a `Generation` and turn the relay's internal events (protocol.worker) into their own bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator.cache import cache_key
from coordinator.conversations import continuation_key, conversation_key
from coordinator.dispatch import OpenStream
from coordinator.errors import CoordinatorError
from coordinator.generation import Generation
from coordinator.queue import QueueClosed
from coordinator.relay import Outcome, Relay
from coordinator.scheduling import Request
from coordinator.supervisor import Ending
from protocol import reasons
from protocol.sse import SseEvent
from protocol.worker import EVENT_DONE, DoneEvent, Timings

if TYPE_CHECKING:
    from coordinator.state import CoordinatorState

# Capacity that is short for now, not a request that cannot be served: worth waiting for.
QUEUEABLE = frozenset({reasons.SESSIONS_FULL, reasons.KV_FULL})
# A stream that ended with one of these counts against its worker's circuit breaker.
WORKER_FAULTS = frozenset({reasons.WORKER_FAILED, reasons.ENGINE_FAILED})


@dataclass(slots=True)
class Opened:
    """An admitted request whose worker has sent its first event: the surface streams `relay`."""

    relay: Relay
    worker_id: str
    model: str
    finish: Callable[[Ending], None]  # call exactly once, when the client's response has ended


class RateLimit:
    """A token bucket: at most `per_second` on average, bursts of up to that many; counts what it refuses."""

    def __init__(self, per_second: float) -> None:
        self._rate = per_second
        self._tokens = per_second
        self._at: float | None = None
        self.left_out = 0

    def allow(self, now: float) -> bool:
        if self._at is not None:
            self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.left_out += 1
        return False


class Gateway:
    def __init__(self, state: CoordinatorState) -> None:
        self._state = state
        self._refusal_log = RateLimit(state.settings.refusal_log_rate)

    def now(self) -> float:
        return self._state.clock.monotonic()

    def resolve_model(self, requested: str | None) -> str | None:
        """The served model a request means, or a `CoordinatorError` (404 names the models served)."""
        registry, default = self._state.registry, self._state.settings.default_model
        if requested is None:
            if default:
                return registry.resolve(default) or default
            known = registry.known_models()
            if len(known) > 1:
                raise CoordinatorError(reasons.INVALID_REQUEST,
                                       f"model: required, this pool serves {', '.join(known)}")
            return known[0] if known else None
        model = registry.resolve(requested)
        if model is None:
            served = ", ".join(registry.known_models()) or "none"
            raise CoordinatorError(reasons.UNKNOWN_MODEL,
                                   f"no worker serves model {requested!r}; served: {served}")
        return model

    async def open(self, gen: Generation, started: float, *,
                   client_gone: Callable[[], Awaitable[None]] | None = None) -> Opened:
        """Admit (waiting in the queue while capacity is short), schedule and dispatch; raises a
        `CoordinatorError` (already counted and logged). `client_gone` returns when the client has
        disconnected, so a request waiting in the queue leaves it at once."""
        state = self._state
        try:
            self._check_own_limits()
            model = self.resolve_model(gen.request.model)
            key = cache_key(gen.surface, model, gen.request) if state.cache.enabled else None
            if key is not None:
                hit = state.cache.get(key)
                state.metrics.cache_lookups.labels(outcome="hit" if hit else "miss").inc()
                if hit is not None:  # answered at once: nothing admitted, reserved or computed
                    return self._replay(gen, model, hit, started)
            gen, stream = await self._admit_in_turn(gen, model, started, client_gone)
            try:
                return self._opened(gen, model, stream, key, started)
            except BaseException:
                state.admission.release(stream.reservation)
                await stream.close()  # the worker cancels the request and frees its sequence
                raise
        except CoordinatorError as exc:
            self.refused(gen.request_id, exc, started, surface=gen.surface)
            raise
        except Exception as exc:  # a bug before the first byte: the client gets a 500 naming no detail
            state.log.error(json.dumps({"event": "internal_error", "task": "open", "request_id": gen.request_id,
                                        "error": repr(exc)}), exc_info=exc)
            state.metrics.internal_errors.labels(task="open").inc()
            internal = CoordinatorError(reasons.INTERNAL, "internal error")
            self.refused(gen.request_id, internal, started, surface=gen.surface)
            raise internal from None

    def _opened(self, gen: Generation, model: str | None, stream: OpenStream, key: bytes | None,
                started: float) -> Opened:
        """The bookkeeping of an admitted request whose worker has sent its first event, and its relay."""
        state = self._state
        session_id, session_key = gen.request.session_id, gen.session_key
        if session_key is not None:
            state.sessions.remember(session_key, stream.worker.worker_id)
        if gen.request.messages is not None and session_id is None:
            state.conversations.remember(conversation_key(gen.request.tenant, model, gen.request.messages),
                                         stream.worker.worker_id)
        settings = state.settings
        reservation, admission = stream.reservation, state.admission
        breakers, worker_id = state.breakers, stream.worker.worker_id
        cache = state.cache

        def final(outcome: Outcome) -> None:
            done = outcome.done
            kept = done.usage.total_tokens if session_id is not None and done is not None else None
            admission.release(reservation, kept_tokens=kept)
            if done is not None:
                breakers.succeeded(worker_id)
                if key is not None and relay.record is not None and done.finish_reason != "cancelled":
                    cache.put(key, tuple(relay.record))  # complete streams only
            elif outcome.error_reason in WORKER_FAULTS:
                breakers.failed(worker_id)
            else:
                breakers.settled(worker_id)  # the client left, or read too slowly: no verdict

        relay = Relay(stream, request_id=gen.request_id, buffer_events=settings.relay_buffer_events,
                      write_deadline=settings.relay_write_deadline, metrics=state.metrics, on_final=final,
                      record_bytes=cache.entry_limit if key is not None else 0)
        state.streams.add(relay)
        state.metrics.admitted()
        state.metrics.requests_running.inc()
        # Only these outlive this call: not the parsed request, nor its prompt.
        surface = gen.surface
        return Opened(relay, stream.worker.worker_id, model or stream.worker.model,
                      lambda ending: self._finish(session_id, surface, relay, stream, ending, started))

    def _replay(self, gen: Generation, model: str | None, events: tuple[SseEvent, ...], started: float) -> Opened:
        """A cache hit: the recorded stream, its `done` marked `cached` with this request's id and no
        completion tokens computed, through the same relay and response as a live one."""
        state, settings = self._state, self._state.settings
        replayed = tuple(_as_hit(e, gen.request_id) if e.event == EVENT_DONE else e for e in events)
        relay = Relay(Replay(replayed), request_id=gen.request_id, buffer_events=settings.relay_buffer_events,
                      write_deadline=settings.relay_write_deadline, metrics=state.metrics)
        surface, done = gen.surface, relay.outcome

        def finish(ending: Ending) -> None:
            finished = done.done.finish_reason if done.done is not None else ending.value
            state.metrics.finished.labels(finish_reason=finished).inc()
            self._log(request_id=relay.request_id, surface=surface, status=200, worker_id="cache", cached=True,
                      finish_reason=finished, duration_ms=_ms(self.now() - started))

        return Opened(relay, "cache", model or "", finish)

    def refused(self, request_id: str, exc: CoordinatorError, started: float, *, surface: str) -> None:
        """Count every request refused before its first byte (a surface's parse errors too), and log
        them at a bounded rate: a flood of 503s must not become a flood of log lines. The next line
        logged says how many were left out since the last one."""
        self._state.metrics.rejected(exc.reason)
        now = self.now()
        if not self._refusal_log.allow(now):
            return
        left_out, self._refusal_log.left_out = self._refusal_log.left_out, 0
        self._log(request_id=request_id, surface=surface, status=exc.status, reason=exc.reason,
                  duration_ms=_ms(now - started), **({"refusals_not_logged": left_out} if left_out else {}))

    async def _admit_in_turn(self, gen: Generation, model: str | None, started: float,
                             client_gone: Callable[[], Awaitable[None]] | None) -> tuple[Generation, OpenStream]:
        """`_admit`, behind the requests already waiting for this model, and waiting (bounded in
        length and time) when capacity is short; nothing is held on any worker while it waits."""
        queue, metrics = self._state.queue, self._state.metrics
        if not queue.enabled() or model is None:
            return await self._admit(gen, model)
        waiter = None
        deadline = started + queue.timeout
        try:
            if queue.waiting(model):
                waiter = queue.join(model)  # FIFO: no overtaking the requests already waiting
            while True:
                placed = None
                if waiter is not None:
                    await queue.wait(waiter, deadline=deadline, now=self.now, client_gone=client_gone)
                    placed = functools.partial(queue.leave, waiter)  # the next may try while this dispatches
                try:
                    result = await self._admit(gen, model, placed)
                except CoordinatorError as exc:
                    if exc.reason not in QUEUEABLE:
                        raise
                    if waiter is None:
                        waiter = queue.join(model)
                    else:
                        queue.rejoin(waiter)  # placed, then refused by the worker: back at the head
                    continue
                if waiter is not None:
                    metrics.dequeued("admitted", self.now() - started)
                return result
        except QueueClosed:
            metrics.dequeued(reasons.CLIENT_GONE, self.now() - started)
            raise CoordinatorError(reasons.CLIENT_GONE, "the client went away while its request waited") from None
        except CoordinatorError as exc:
            if exc.reason in (reasons.QUEUE_FULL, reasons.QUEUE_TIMEOUT):
                metrics.dequeued(exc.reason, self.now() - started)
            raise
        finally:
            if waiter is not None:
                queue.leave(waiter)  # admitted or not: the next one may try now

    def _check_own_limits(self) -> None:
        """Also the process's own limit: past `max_streams` relayed at once, one more would slow them all."""
        state = self._state
        if state.draining:
            raise CoordinatorError(reasons.DRAINING, "the coordinator is shutting down; try another",
                                   retry_after=state.settings.retry_after)
        if len(state.streams) >= state.settings.max_streams:
            raise CoordinatorError(reasons.STREAMS_FULL, f"this coordinator is relaying {len(state.streams)} "
                                   "streams, its limit", retry_after=state.settings.retry_after)

    async def _admit(self, gen: Generation, model: str | None,
                     placed: Callable[[], None] | None = None) -> tuple[Generation, OpenStream]:
        """`placed` runs once a worker's capacity is reserved for it, before that worker answers."""
        state, body = self._state, gen.request
        self._check_own_limits()  # also for a request that waited in the queue
        key = gen.session_key
        if key is None or state.sessions.worker_of(key) is not None:
            return await self._place(gen, model, placed)
        # A first turn: one at a time per id, or two workers would each start the conversation.
        if not state.sessions.claim(key):
            raise CoordinatorError(reasons.SESSION_BUSY,
                                   f"session {body.session_id!r} is starting on another request; send turns one at a time")
        try:
            result = await self._place(gen, model, placed)
            state.sessions.remember(key, result[1].worker.worker_id)
            return result
        finally:
            state.sessions.unclaim(key)

    async def _place(self, gen: Generation, model: str | None,
                     placed: Callable[[], None] | None) -> tuple[Generation, OpenStream]:
        state, body = self._state, gen.request
        session_key = gen.session_key
        session_worker = state.sessions.worker_of(session_key) if session_key is not None else None
        if session_worker is not None:
            # It continues a conversation: the worker already holds its sequence slot.
            gen = dataclasses.replace(gen, demand=dataclasses.replace(gen.demand, new_session=False))
        state.admission.check(gen.demand, model)
        prefer, hashes, match = None, [], {}
        if session_worker is not None:
            record = state.registry.get(session_worker)
            candidates = [record] if record is not None else []
        else:
            candidates = list(state.registry.alive(model))
            key = continuation_key(body.tenant, model, body.messages) if body.messages is not None else None
            prefer = state.conversations.worker_of(key) if key is not None else None
            if state.policy.uses("prefix"):
                hashes = state.prefixes.hashes(model, body)
                match = state.prefixes.match(hashes)
        decision = state.policy.select(
            Request(gen.demand, model, body.session_id, session_worker, prefer, prefix_match=match,
                    turn=next(state.turns), rng=state.rng),
            candidates, now=state.clock.monotonic())
        if decision.reason is not None:
            if decision.reason == reasons.UNKNOWN_SESSION:
                if session_key is not None:
                    state.sessions.forget(session_key)  # said once; the id may now start afresh
                raise CoordinatorError(reasons.UNKNOWN_SESSION,
                                       f"session {body.session_id!r} lived on a worker that is gone; start a new one")
            raise CoordinatorError(decision.reason, f"no worker can take it now: {decision.reason}",
                                   retry_after=state.settings.retry_after)
        ranked = [state.registry.get(w.worker_id) for w in decision.ranked]
        try:
            stream = await state.dispatcher.open(gen, [w for w in ranked if w is not None], reserved=placed)
        except CoordinatorError as exc:
            if session_key is not None and exc.reason in (reasons.SESSION_EXPIRED, reasons.UNKNOWN_SESSION):
                state.sessions.forget(session_key)
            raise
        if hashes:
            state.prefixes.record(hashes, stream.worker.worker_id)
        return gen, stream

    def _finish(self, session_id: str | None, surface: str, relay: Relay, stream: OpenStream, ending: Ending,
                started: float) -> None:
        """Runs once per admitted request, whatever the ending: release, count, log."""
        state = self._state
        state.streams.discard(relay)
        outcome = relay.outcome
        done = outcome.done
        kept = done.usage.total_tokens if session_id is not None and done is not None else None
        state.admission.release(stream.reservation, kept_tokens=kept)  # done already, unless cut short
        now = state.clock.monotonic()
        metrics = state.metrics
        metrics.requests_running.dec()
        metrics.generation_tokens.inc(outcome.tokens)
        metrics.e2e.observe(now - started)
        if outcome.first_token_at is not None:
            metrics.ttft.observe(outcome.first_token_at - started)
            record = state.registry.get(stream.worker.worker_id)
            if record is not None:  # least-latency's signal: what this worker's clients waited
                record.observe_ttft(outcome.first_token_at - started, now)
        if ending is Ending.SLOW_CLIENT:
            metrics.slow_clients.inc()
            finish = reasons.SLOW_CONSUMER
        elif ending is Ending.CLIENT_GONE:
            metrics.client_disconnects.inc()
            finish = "client_gone"
        elif ending is Ending.INTERNAL:
            finish = reasons.INTERNAL  # logged and counted by the supervisor, once
        else:
            finish = done.finish_reason if done is not None else (outcome.error_reason or reasons.WORKER_FAILED)
        metrics.finished.labels(finish_reason=finish).inc()
        self._log(request_id=relay.request_id, surface=surface, status=200, worker_id=stream.worker.worker_id,
                  model=done.model if done else stream.worker.model, finish_reason=finish,
                  prompt_tokens=done.usage.prompt_tokens if done else None,
                  cached_tokens=done.usage.cached_tokens if done else None,
                  generated_tokens=done.usage.completion_tokens if done else outcome.tokens,
                  ttft_ms=_ms(outcome.first_token_at - started) if outcome.first_token_at is not None else None,
                  duration_ms=_ms(now - started), attempts=stream.attempts)

    def _log(self, **fields: Any) -> None:
        self._state.log.info(json.dumps({"event": "request", **fields}, separators=(",", ":")))


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class Replay:
    """A recorded stream, read like a worker's (relay.Upstream)."""

    def __init__(self, events: tuple[SseEvent, ...]) -> None:
        self.first = events[0]
        self.events = self._rest(events[1:])

    @staticmethod
    async def _rest(events: tuple[SseEvent, ...]) -> AsyncIterator[SseEvent]:
        for event in events:
            yield event

    async def close(self) -> None:
        pass


def _as_hit(event: SseEvent, request_id: str) -> SseEvent:
    done = DoneEvent.model_validate_json(event.data)
    usage = done.usage.model_copy(update={"completion_tokens": 0, "cached_tokens": done.usage.prompt_tokens,
                                          "total_tokens": done.usage.prompt_tokens})
    timings = Timings(queue_ms=0.0, prefill_ms=0.0, ttft_ms=0.0, total_ms=0.0, tokens_per_second=0.0)
    hit = done.model_copy(update={"cached": True, "request_id": request_id, "usage": usage, "timings": timings,
                                  "worker_id": "cache"})
    return SseEvent(EVENT_DONE, hit.model_dump_json())
