"""Worker-facing and operator-facing health: heartbeats in, registry listings out.

Owns: `POST /coordinator/health/heartbeat` (token check, timestamp sanity, a new worker's probe, upsert,
a leaving worker's last beat),
`GET /coordinator/health`, `GET /coordinator/ready` and `GET /coordinator/health/workers`.
Must not: schedule or admit requests.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from coordinator.admission.demand import Demand
from coordinator.errors import CoordinatorError
from coordinator.pool.registry import ALIVE, WorkerRecord
from coordinator.relay.continuation import Continuing
from coordinator.scheduling import Policy
from coordinator.scheduling import Request as Wanted
from coordinator.state import CoordinatorState
from coordinator.validate import describe
from protocol import reasons
from protocol.coordinator import (
    CoordinatorHealth,
    CoordinatorReadiness,
    HeartbeatAck,
    WorkerCounts,
    WorkerStatus,
    WorkerStatusList,
)
from protocol.health import MAX_HEARTBEAT_TENANTS, Heartbeat
from protocol.openapi import inlined
from protocol.worker import PROTOCOL_VERSION, ErrorBody

router = APIRouter()
log = logging.getLogger("coordinator")


HEARTBEAT_PATH = "/coordinator/health/heartbeat"


_HEARTBEAT_REFUSALS = {400: "`invalid_request`: not a valid heartbeat, another protocol version, a clock too far off",
                       401: "`unauthorized`: the worker token is set and the heartbeat does not carry it",
                       409: "`worker_conflict`: without a worker token, a live worker's id from another URL",
                       502: "`worker_unavailable`: a new worker id (or one at a new URL) whose URL did not answer "
                            "`GET /worker/health` as that worker within `WORKER_PROBE_TIMEOUT`; not registered",
                       413: "`body_too_large`: over 96 KiB"}


@router.post(HEARTBEAT_PATH, openapi_extra={"requestBody": {
    "required": True, "content": {"application/json": {"schema": inlined(Heartbeat)}}}},
    responses={status: {"model": ErrorBody, "description": text} for status, text in _HEARTBEAT_REFUSALS.items()})
async def heartbeat(request: Request) -> HeartbeatAck:
    return await _take(request)


async def heartbeat_response(request: Request) -> Response:
    """The same intake as `heartbeat`, reached through app.py's fast paths: every worker beats to every
    coordinator, so FastAPI's router and its response model would cost each coordinator process a
    share of its core that does not shrink with its share of the tokens."""
    ack = await _take(request)
    return Response(ack.model_dump_json(), media_type="application/json")


async def _take(request: Request) -> HeartbeatAck:
    state: CoordinatorState = request.app.state.coordinator
    settings = state.settings
    if settings.worker_token:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {settings.worker_token}".encode()):
            state.metrics.heartbeats.labels(outcome="unauthorized").inc()
            raise CoordinatorError(reasons.UNAUTHORIZED, "heartbeat without the right worker token")
    try:
        beat = Heartbeat.model_validate_json(await request.body())
        _check(beat, now_wall=state.clock.time(), max_skew=settings.heartbeat_max_skew,
               max_age=settings.dead_after)
    except ValidationError as exc:
        state.metrics.heartbeats.labels(outcome="invalid").inc()
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc)) from None
    except CoordinatorError:
        state.metrics.heartbeats.labels(outcome="invalid").inc()
        raise
    now = state.clock.monotonic()
    if beat.leaving:
        return _left(state, beat, now)
    if _check_identity(state, beat, now):
        await _prove(state, beat)
        now = state.clock.monotonic()
        _check_identity(state, beat, now, quiet=True)  # what another heartbeat changed meanwhile
    record = state.registry.upsert(beat.model_copy(update={"load": beat.load.clamped()}), now)
    state.prefixes.report(record.worker_id, beat.load.prefixes)  # the prompts its cells hold now
    # What it served each tenant, what runs there, and who waits for its model at any coordinator.
    state.fair.beat(record.worker_id, record.model, beat.load.tenants, beat.load.waiting)
    state.registry.sweep(now)
    state.readiness.heard(beat.pool_workers)
    state.queue.wake(record.model)  # it may have room now (and catches any wake-up missed before)
    if not record.draining:
        state.loads.served(record.model)  # an ask for its model is answered
    for offer in record.offered:  # requests waiting for a model it may load, or for its swap to end
        state.queue.wake(offer.name)
    state.embedding_queue.wake(record.model)
    if not record.draining:
        state.mover.serving(record.worker_id)
        state.stored.serving(record.worker_id)
    else:
        state.stored.draining(record)  # its stored responses go to the other workers, once
        for relay in state.streams:  # its streams too, where another worker has room
            if isinstance(relay.stream, Continuing):
                relay.stream.move(record.worker_id)
        if record.load.sessions:
            state.mover.draining(record)  # its kept sessions go to the model's other workers, once
    state.metrics.heartbeats.labels(outcome="accepted").inc()
    return HeartbeatAck(worker_id=record.worker_id, state="alive",
                        heartbeat_interval=settings.heartbeat_interval, workers=state.registry.alive_count,
                        waiting=state.queue.waiting_tenants(record.model, MAX_HEARTBEAT_TENANTS))


def _left(state: CoordinatorState, beat: Heartbeat, now: float) -> HeartbeatAck:
    """A worker's last beat: it stops now. Out of the pool at once (`Registry.lost`), unless the id is
    registered at another URL (whoever holds it there is not leaving). Nothing is registered."""
    record = state.registry.get(beat.worker_id)
    if record is not None and record.url == beat.url:
        state.registry.lost(beat.worker_id, now)
        log.info(json.dumps({"event": "worker_left", "worker_id": beat.worker_id}))
    state.metrics.heartbeats.labels(outcome="leaving").inc()
    return HeartbeatAck(worker_id=beat.worker_id, state="stale", heartbeat_interval=state.settings.heartbeat_interval,
                        workers=state.registry.alive_count)


async def _prove(state: CoordinatorState, beat: Heartbeat) -> None:
    """A new registration is made only once its URL answers as this worker (coordinator/pool/probe.py)."""
    try:
        await state.probe.prove(beat.worker_id, beat.url)
    except CoordinatorError as refused:
        state.metrics.heartbeats.labels(outcome="unproven").inc()
        log.warning(json.dumps({"event": "worker_unproven", "worker_id": beat.worker_id, "url": beat.url,
                                "detail": refused.message}))
        raise


def _check_identity(state: CoordinatorState, beat: Heartbeat, now: float, *, quiet: bool = False) -> bool:
    """A worker id may move to another URL (a rescheduled pod gets a new address), but without a
    worker token anyone could claim a live worker's id and receive its users' prompts: then the move
    is refused until the old registration is no longer alive. Every move is logged (unless `quiet`).
    True: the id is new here, or moves, so its URL must be proven first."""
    settings = state.settings
    if settings.worker_url_pattern and not re.fullmatch(settings.worker_url_pattern, beat.url):
        state.metrics.heartbeats.labels(outcome="invalid").inc()
        raise CoordinatorError(reasons.INVALID_REQUEST, "url: not an address this coordinator accepts workers at")
    state.registry.sweep(now)
    known = state.registry.get(beat.worker_id)
    if known is None or known.url == beat.url:
        return known is None
    if not settings.worker_token and known.state == ALIVE:
        state.metrics.heartbeats.labels(outcome="conflict").inc()
        log.warning(json.dumps({"event": "worker_conflict", "worker_id": beat.worker_id, "registered_url": known.url,
                                "claimed_url": beat.url}))
        raise CoordinatorError(reasons.WORKER_CONFLICT, f"worker {beat.worker_id!r} is alive at another URL; "
                               "without a worker token its id cannot move until it stops heartbeating")
    if not quiet:
        log.warning(json.dumps({"event": "worker_moved", "worker_id": beat.worker_id, "from": known.url,
                                "to": beat.url}))
    return True


def _check(beat: Heartbeat, *, now_wall: float, max_skew: float, max_age: float) -> None:
    if beat.protocol != PROTOCOL_VERSION:
        # Registering it would route it requests it would misread (or refuse, one by one).
        raise CoordinatorError(reasons.INVALID_REQUEST, f"protocol: the worker speaks version {beat.protocol}, "
                               f"this coordinator {PROTOCOL_VERSION}")
    if not beat.url.startswith(("http://", "https://")):
        raise CoordinatorError(reasons.INVALID_REQUEST, "url: must be an http:// or https:// URL")
    if beat.timestamp > now_wall + max_skew:
        raise CoordinatorError(reasons.INVALID_REQUEST,
                               f"timestamp: {beat.timestamp - now_wall:.1f} s in the future")
    if beat.timestamp < now_wall - max_age:
        raise CoordinatorError(reasons.INVALID_REQUEST, f"timestamp: {now_wall - beat.timestamp:.1f} s old")


@router.get("/coordinator/health", responses={503: {"model": CoordinatorHealth, "description": "draining"}})
@router.get("/health", responses={503: {"model": CoordinatorHealth, "description": "draining"}},
            summary="The same as /coordinator/health, at the path most probes and benchmark tools ask")
async def health_route(request: Request, response: Response) -> CoordinatorHealth:
    summary = await health(request)
    if summary.status == "draining":
        response.status_code = 503
    return summary


async def health(request: Request) -> CoordinatorHealth:
    state: CoordinatorState = request.app.state.coordinator
    registry = state.registry
    registry.sweep(state.clock.monotonic())
    counts = WorkerCounts(alive=registry.alive_count, stale=registry.stale_count,
                          total=registry.alive_count + registry.stale_count)
    return CoordinatorHealth(status="draining" if state.draining else "ok" if counts.alive else "no_workers",
                             workers=counts,
                             models=registry.alive_models(),
                             requests_running=state.admission.in_flight,
                             kv_reserved_bytes=max(0, state.admission.in_flight_kv_bytes),
                             cache=state.cache.state, cache_failure=state.cache.failure)


@router.get("/coordinator/ready", responses={503: {"model": CoordinatorReadiness,
                                                   "description": "joining (not yet heard from the pool) or draining"}})
async def ready(request: Request, response: Response) -> CoordinatorReadiness:
    state: CoordinatorState = request.app.state.coordinator
    state.registry.sweep(state.clock.monotonic())
    status = state.readiness.status(draining=state.draining)
    if status != "ready":
        response.status_code = 503
    return CoordinatorReadiness(status=status, workers=state.registry.alive_count)


@router.get("/coordinator/health/workers")
async def workers(request: Request) -> WorkerStatusList:
    state: CoordinatorState = request.app.state.coordinator
    now = state.clock.monotonic()
    state.registry.sweep(now)
    return WorkerStatusList(routing_policy=state.settings.routing_policy, scorers=state.settings.scorers,
                            workers=[_status(state.policy, w, now) for w in sorted(state.registry.all(),
                                                                                  key=lambda w: w.worker_id)])


# The listing scores each worker for a small new request (prefix scorers then see no prefix).
_PROBE = Wanted(Demand(prompt_bytes=1, max_tokens=1))


def _status(policy: Policy, w: WorkerRecord, now: float) -> WorkerStatus:
    load = w.load
    total, parts = policy.score(_PROBE, w)
    breaker: Literal["closed", "open", "probing"] = (
        "probing" if w.breaker_probing else "open" if w.breaker_open_until > now else "closed")
    return WorkerStatus(
        worker_id=w.worker_id, url=w.url, model=w.model, state="alive" if w.state == ALIVE else "stale",
        heartbeat_age_s=max(0.0, now - w.last_seen), sessions=w.sessions, max_sessions=w.max_sessions,
        active_streams=load.active_streams, queue_depth=load.queue_depth, kv_used_bytes=load.kv_used_bytes,
        kv_reserved_bytes=w.kv_reserved_bytes, kv_capacity_bytes=w.kv_capacity_bytes,
        bytes_per_token=w.bytes_per_token, session_max_tokens=w.session_max_tokens, draining=w.draining,
        score=round(total, 6) if w.state == ALIVE else None,
        score_parts={name: round(part, 6) for name, part in parts.items()} if w.state == ALIVE else {},
        breaker=breaker, in_flight=w.in_flight,
        ttft_ewma_ms=round(w.ttft_ewma * 1e3, 3) if w.ttft_ewma is not None else None,
        picked_age_s=round(max(0.0, now - w.picked_at), 3) if w.picked_at else None,
        embeddings=w.embeddings, embedding_requests=w.embedding_requests, offered=list(w.offered),
        swapping=w.swapping, standby=w.standby, last_swap_s=round(w.last_swap_s, 3) if w.last_swap_s is not None else None)
