"""`POST /coordinator/infer`: validate, admit, schedule, dispatch, then hand the stream to the relay.

Owns: the order of those steps (so the status code is decided before the first byte), session
affinity bookkeeping, and the one structured log line per finished request (no prompt, no output).
Must not: implement any step itself; each lives in its own module.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from coordinator import scheduler
from coordinator.dispatch import OpenStream
from coordinator.errors import CoordinatorError
from coordinator.relay import Relay
from coordinator.response import Ending, RelayResponse
from coordinator.state import CoordinatorState
from coordinator.validate import ValidRequest, parse_infer, read_body, request_id_of
from protocol import reasons

router = APIRouter()


@router.post("/coordinator/infer", response_model=None)
async def infer(request: Request) -> Response:
    state: CoordinatorState = request.app.state.coordinator
    started = state.clock.monotonic()
    request_id = request_id_of(request)
    try:
        valid = parse_infer(await read_body(request, state.settings.max_body_bytes), request_id)
        valid, stream = await _admit(state, valid)
    except CoordinatorError as exc:
        state.metrics.rejected(exc.reason)
        _log(state, request_id=request_id, status=exc.status, reason=exc.reason,
             duration_ms=_ms(state.clock.monotonic() - started))
        raise
    state.metrics.admitted()
    state.metrics.requests_running.inc()
    if valid.body.session_id is not None:
        state.sessions.remember(valid.body.session_id, stream.worker.worker_id)
    settings = state.settings
    relay = Relay(stream, request_id=request_id, buffer_events=settings.relay_buffer_events,
                  write_deadline=settings.relay_write_deadline, metrics=state.metrics)
    # Only the session id outlives this function: the parsed request and its prompt are not held
    # for as long as the stream lasts.
    session_id = valid.body.session_id
    return RelayResponse(
        relay, headers={"x-request-id": request_id, "x-worker-id": stream.worker.worker_id},
        ping_interval=settings.ping_interval, clock=state.clock,
        on_end=lambda ending: _finish(state, session_id, relay, ending, started))


async def _admit(state: CoordinatorState, valid: ValidRequest) -> tuple[ValidRequest, OpenStream]:
    body = valid.body
    session_worker = state.sessions.worker_of(body.session_id) if body.session_id else None
    if session_worker is not None:
        # It continues a conversation: the worker already holds its sequence slot.
        valid = dataclasses.replace(valid, demand=dataclasses.replace(valid.demand, new_session=False))
    state.admission.check(valid.demand, body.model)
    if session_worker is not None:
        record = state.registry.get(session_worker)
        candidates = [record] if record is not None else []
    else:
        candidates = list(state.registry.alive(body.model))
    decision = scheduler.select(
        scheduler.Request(valid.demand, body.model, body.session_id, session_worker),
        candidates, now=state.clock.monotonic(), stale_after=state.settings.stale_after)
    if decision.reason is not None:
        if decision.reason == reasons.UNKNOWN_SESSION:
            state.sessions.forget(body.session_id or "")  # said once; the id may now start afresh
            raise CoordinatorError(reasons.UNKNOWN_SESSION,
                                   f"session {body.session_id!r} lived on a worker that is gone; start a new one")
        raise CoordinatorError(decision.reason, f"no worker can take it now: {decision.reason}",
                               retry_after=state.settings.retry_after)
    ranked = [state.registry.get(w.worker_id) for w in decision.ranked]
    try:
        return valid, await state.dispatcher.open(valid, [w for w in ranked if w is not None])
    except CoordinatorError as exc:
        if body.session_id is not None and exc.reason in (reasons.SESSION_EXPIRED, reasons.UNKNOWN_SESSION):
            state.sessions.forget(body.session_id)
        raise


def _finish(state: CoordinatorState, session_id: str | None, relay: Relay, ending: Ending, started: float) -> None:
    """Runs once per admitted request, whatever the ending: release, count, log."""
    outcome, stream = relay.outcome, relay.stream
    done = outcome.done
    kept = done.usage.total_tokens if session_id is not None and done is not None else None
    state.admission.release(stream.reservation, kept_tokens=kept)
    now = state.clock.monotonic()
    metrics = state.metrics
    metrics.requests_running.dec()
    metrics.generation_tokens.inc(outcome.tokens)
    metrics.e2e.observe(now - started)
    if outcome.first_token_at is not None:
        metrics.ttft.observe(outcome.first_token_at - started)
    if ending is Ending.SLOW_CLIENT:
        metrics.slow_clients.inc()
        finish = reasons.SLOW_CONSUMER
    elif ending is Ending.CLIENT_GONE:
        metrics.client_disconnects.inc()
        finish = "client_gone"
    else:
        finish = done.finish_reason if done is not None else (outcome.error_reason or reasons.WORKER_FAILED)
    metrics.finished.labels(finish_reason=finish).inc()
    _log(state, request_id=relay.request_id, status=200, worker_id=stream.worker.worker_id,
         model=done.model if done else stream.worker.model, finish_reason=finish,
         prompt_tokens=done.usage.prompt_tokens if done else None,
         generated_tokens=done.usage.completion_tokens if done else outcome.tokens,
         ttft_ms=_ms(outcome.first_token_at - started) if outcome.first_token_at is not None else None,
         duration_ms=_ms(now - started), attempts=stream.attempts)


def _log(state: CoordinatorState, **fields: Any) -> None:
    state.log.info(json.dumps({"event": "request", **fields}, separators=(",", ":")))


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
