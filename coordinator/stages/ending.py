"""The single end of an admitted request: its relay, and what is given back, counted and logged once
its answer has ended, however it ended.

Owns: the relay of a request whose worker has sent its first event (or of a response-cache hit), its
final callback (the reservation back as soon as the worker freed the slot, the breakers' verdict on
the worker, the complete answer into the response cache, the tenant's generated tokens), and the
request's `finish` (the reservation back if it ended short, the stream off the open set, the log line
and request metrics: relay/requests.py), and the `End` its stages read.
Must not: admit or place anything (the gateway orders those steps), nor charge fair shares or key
limits (their stages do, from the `End`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.cache import Replay
from coordinator.generation import Generation
from coordinator.metrics import tenant_label
from coordinator.relay.continuation import Break, Continuing, Resume
from coordinator.relay.dispatch import OpenStream
from coordinator.relay.stream import Outcome, Relay
from coordinator.relay.supervisor import Ending
from coordinator.stages import End
from protocol import reasons
from protocol.sse import SseEvent

if TYPE_CHECKING:
    from coordinator.state import CoordinatorState

CACHE_HIT = "cache"  # an `Opened`'s worker id when the response cache answered
# A stream that ended with one of these counts against its worker's circuit breaker.
WORKER_FAULTS = frozenset({reasons.WORKER_FAILED, reasons.ENGINE_FAILED})


@dataclass(slots=True)
class Opened:
    """An admitted request whose worker has sent its first event: the surface streams `relay`."""

    relay: Relay
    worker_id: str
    model: str
    finish: Callable[[Ending], None]  # call exactly once, when the client's response has ended
    prompt_tokens: int | None = None  # the prompt's length as its worker admitted it; None: a cached answer
    upstream: Continuing | None = None  # a live stream's workers (None: a cached answer)

    @property
    def last_worker(self) -> str:
        """The worker that ran its end: the first one, or the one that continued it."""
        return self.upstream.current.worker.worker_id if self.upstream is not None else self.worker_id

    def end(self) -> End:
        """How it ended, for its stages: its usage as the worker counted it, or the tokens relayed when
        it ended without one; nothing for a cached answer."""
        outcome = self.relay.outcome
        done = outcome.done
        if done is not None:
            attributes: dict[str, str | int] = {
                "llm_pool.finish_reason": done.finish_reason, "llm_pool.prompt_tokens": done.usage.prompt_tokens,
                "llm_pool.completion_tokens": done.usage.completion_tokens}
        else:
            attributes = {"llm_pool.tokens_relayed": outcome.tokens}
        failure = None if done is not None else outcome.error_reason or "cut"
        if self.worker_id == CACHE_HIT:
            return End(self.worker_id, self.model, failure=failure, attributes=attributes)
        prompt, generated = ((done.usage.prompt_tokens, done.usage.completion_tokens) if done is not None
                             else (0, outcome.tokens))
        return End(self.worker_id, self.model, prompt, generated, outcome.tokens, failure, attributes)


def relayed(state: CoordinatorState, gen: Generation, model: str | None, stream: OpenStream,
            cached: tuple[bytes, str] | None, started: float, on_token: Callable[[], None] | None,
            resume: Resume | None = None, *, not_continued: str = "") -> Opened:
    """The relay of a request whose worker has sent its first event, with its final callback.
    `cached`: its response-cache key and the model's identity, when its answer may be kept.
    `on_token`: called for each token event relayed (the fair charge). `resume`: places the rest of it on
    another worker when its worker fails mid-stream (relay/continuation.py); None: never continued, and
    `not_continued` says why, if it is not for want of continuations."""
    session_id = gen.request.session_id
    admission, breakers, cache, metrics = state.admission, state.breakers, state.cache, state.metrics
    generated = metrics.tenant_tokens.labels(tenant=tenant_label(gen.request.tenant), kind="generated")

    def left(old: OpenStream, broke: Break) -> None:
        """A stream given up mid-way for a continuation (or a choice's continuation that ended or was
        left): its reservation back, its worker judged (no verdict when it only drains, or was left)."""
        admission.release(old.reservation)
        if broke.failed:
            breakers.failed(broke.worker_id)
        elif broke.succeeded:
            breakers.succeeded(broke.worker_id)
        else:
            breakers.settled(broke.worker_id)  # no verdict: a probe slot it held is free again

    upstream = Continuing(stream, _never if resume is None else resume, request_id=gen.request_id,
                          at_most=state.settings.continuations if resume is not None else 0, left=left,
                          metrics=metrics, not_continued=not_continued, choices=gen.request.n,
                          max_tokens=gen.request.max_tokens, kept=session_id is not None)

    def release(outcome: Outcome) -> None:
        """The reservation back (a second call does nothing); a named session that ended `done`
        stays counted as kept, with all its tokens, until the worker's heartbeat says otherwise."""
        done = outcome.done
        admission.release(upstream.current.reservation, kept_tokens=done.usage.total_tokens
                          if session_id is not None and done is not None else None)

    def final(outcome: Outcome) -> None:
        release(outcome)
        done = outcome.done
        worker_id = upstream.current.worker.worker_id
        # A token event may carry several tokens (a character split across them): all of them.
        generated.inc(max(done.usage.completion_tokens, outcome.tokens) if done is not None else outcome.tokens)
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
    relay = Relay(upstream, request_id=gen.request_id, buffer_events=settings.relay_buffer_events,
                  write_deadline=settings.relay_write_deadline, metrics=state.metrics, on_final=final,
                  record_bytes=cache.entry_limit if cached is not None else 0, on_token=on_token)
    state.streams.add(relay)
    try:
        state.metrics.admitted()
        state.metrics.requests_running.inc()
    except BaseException:
        state.streams.discard(relay)  # the gateway gives the reservation back and closes the worker request
        raise
    # Only these outlive this call: not the parsed request, nor its prompt.
    surface, trace_id = gen.surface, gen.trace.trace_id

    def finish(ending: Ending) -> None:
        """Runs once per admitted request, whatever the ending: release, count, log."""
        state.streams.discard(relay)
        release(relay.outcome)  # done already, unless cut short
        state.requests.finished(relay.request_id, surface, upstream.current, relay.outcome, ending, started,
                                trace_id, continuations=upstream.continuations)

    return Opened(relay, stream.worker.worker_id, model or stream.worker.model, finish, stream.prompt_tokens,
                  upstream)


async def _never(choice: int, generated: list[int], avoid: frozenset[str], waits: bool, holder: str | None
                 ) -> OpenStream:
    raise AssertionError("a stream without continuations never resumes")  # pragma: no cover


def replayed(state: CoordinatorState, gen: Generation, model: str | None, events: tuple[SseEvent, ...],
             started: float) -> Opened:
    """A cache hit: the recorded stream through the same relay and response as a live one."""
    settings = state.settings
    relay = Relay(Replay(events, gen.request_id), request_id=gen.request_id,
                  buffer_events=settings.relay_buffer_events, write_deadline=settings.relay_write_deadline,
                  metrics=state.metrics)
    surface = gen.surface
    return Opened(relay, CACHE_HIT, model or "",
                  lambda ending: state.requests.replayed(relay.request_id, surface, relay.outcome, ending, started))
