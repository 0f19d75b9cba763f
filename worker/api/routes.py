"""The worker's routes: generate (SSE), embed (JSON), health, sessions, metrics, and what they document.

Owns: each route's checks before admission (the worker token, the protocol version, the request's
headers), turning engine stream items into SSE events, the per-request log line, and the OpenAPI
description of the routes.
Must not: decide admission (admission.Gate does) or touch llama.cpp. The status code is fixed by the
checks that need no tokenizing (`Gate.check`); the head goes then, before the prompt is prepared, so
a refusal found while preparing, and every failure after, is an `error` event.

The worker token: when one is set, every route but `GET /worker/health` needs it (401 `unauthorized`):
generate, embed, the session listing and deletion (session ids and tenants are the coordinator's clients'
business) and `/metrics` (a scraper sends it as a bearer token). Health stays open on purpose:
Kubernetes probes and load balancers cannot send a secret, and it tells only load and status.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from protocol import reasons
from protocol.health import SessionList, WorkerHealth
from protocol.sse import encode
from protocol.worker import (
    EMBED_PATH,
    EVENT_ADMITTED,
    EVENT_DONE,
    EVENT_ERROR,
    EVENT_PROMPT,
    EVENT_TOKEN,
    GENERATE_PATH,
    HEALTH_PATH,
    MAX_STREAM_REF,
    PING_INTERVAL,
    PROMPT_EVENT_TOKENS,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    REQUEST_ID_HEADER,
    SESSION_EXPECTED_HEADER,
    SESSIONS_PATH,
    STREAM_REF_HEADER,
    TENANT_PATTERN,
    WORKER_ID_HEADER,
    AdmittedEvent,
    ChoiceEnd,
    DoneEvent,
    EmbedRequest,
    EmbedResponse,
    ErrorBody,
    ErrorEvent,
    GenerateRequest,
    PromptEvent,
    Timings,
    Usage,
)
from serving import tracing
from serving.tracing import NO_TRACE, Trace
from worker.admission import Ticket
from worker.api.event_stream import EventStream, token_event
from worker.api.slots import slot_of, slots_of
from worker.engine.jobs import Failed, Finished, Job, PromptScored, StreamItem
from worker.errors import WorkerError
from worker.metrics import WorkerMetrics
from worker.runtime import WorkerRuntime
from worker.slots.slot import beating

log = logging.getLogger("worker.requests")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
router = APIRouter()
_UNAUTHORIZED_TEXT = "`unauthorized`: the worker token is set and the request does not carry it"
_UNAUTHORIZED: dict[str, Any] = {"model": ErrorBody, "description": _UNAUTHORIZED_TEXT}


_GENERATE_REFUSALS: dict[int | str, str] = {
    400: "`invalid_request` or `protocol_mismatch`",
    401: _UNAUTHORIZED_TEXT,
    404: "`unknown_model`, `session_expired`, or `unknown_session` (with X-Session-Expected)",
    409: "`session_busy`: the session is generating",
    413: "`body_too_large`",
    503: "`loading` or `draining`, with Retry-After",
    "4XX": "any other refusal (`request_timeout`, `headers_too_large`, an unknown method)",
}


def _generate_responses() -> dict[int | str, dict[str, Any]]:
    """`/worker/generate`'s answers as OpenAPI describes them: the event stream (`itemSchema` is one
    event, as FastAPI writes it for its own SSE routes) or a refusal in `ErrorBody`. "4XX" also keeps
    FastAPI from documenting a 422 this worker never sends (its validation errors are 400s)."""
    header = {"schema": {"type": "string"}}
    event = {"type": "object", "required": ["event", "data"],
             "properties": {"event": {"type": "string",
                                      "enum": [EVENT_ADMITTED, EVENT_PROMPT, EVENT_TOKEN, EVENT_DONE, EVENT_ERROR]},
                            "data": {"type": "string", "description": "JSON: `AdmittedEvent`, `PromptEvent`, "
                                     "`TokenEvent`, `DoneEvent` or `ErrorEvent` (protocol/worker.py)"}}}
    found: dict[int | str, dict[str, Any]] = {200: {
        "description": "the head at once, then `admitted` once the prompt is tokenized and its capacity "
                       "reserved, with `prompt_logprobs` one `prompt` event, `token` events and one `done` event, or an `error` event if the stream "
                       "cannot finish. An `error` instead of `admitted` is a refusal (nothing ran): "
                       "`prompt_too_long`, `sessions_full`, `kv_full` or `session_busy`",
        "headers": {REQUEST_ID_HEADER: header, WORKER_ID_HEADER: header},
        "content": {"text/event-stream": {"itemSchema": event}}}}
    for status, description in _GENERATE_REFUSALS.items():
        found[status] = {"model": ErrorBody, "description": description,
                         "headers": {REQUEST_ID_HEADER: header}}
    found[503]["headers"]["retry-after"] = {"required": True, **header}
    return found


# What GenerateRequest's validator adds to its JSON schema: exactly one of `prompt` and `messages`.
_ONE_OF_PROMPT_OR_MESSAGES = {"content": {"application/json": {"schema": {"oneOf": [
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]}}}}


def _generate_headers() -> list[dict[str, Any]]:
    """The request headers the coordinator sends with a generation (read from the request, not parameters)."""
    return [
        {"name": REQUEST_ID_HEADER, "in": "header", "required": False,
         "schema": {"type": "string", "pattern": f"^{REQUEST_ID.pattern}$"},
         "description": "the coordinator's id for the request; otherwise a new one is made"},
        {"name": PROTOCOL_HEADER, "in": "header", "required": False,
         "schema": {"type": "string", "enum": [str(PROTOCOL_VERSION)]},
         "description": "the protocol version the request speaks; another one: 400 `protocol_mismatch`"},
        {"name": SESSION_EXPECTED_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
         "description": "`1`: continue a session this worker holds, or 404 `unknown_session`"},
        {"name": STREAM_REF_HEADER, "in": "header", "required": False,
         "schema": {"type": "string", "pattern": "^[0-9]{1,19}$"},
         "description": "the coordinator's reference of the stream, listed in heartbeats (`load.streams`) "
                        "while it holds a session; not a number below 2**63: 400 `invalid_request`"}]


def runtime_of(request: Request) -> WorkerRuntime:
    """The runtime of the model the request's slot serves (worker/api/slots.py), or 503 `loading`."""
    slot = slot_of(request)
    if slot.runtime is None:
        if slot.standby is not None:
            raise WorkerError(reasons.LOADING, f"no model is loaded ({slot.standby.names.name} was unloaded, "
                                               "idle past the keep-alive): POST /worker/models/load loads one")
        raise WorkerError(reasons.LOADING, "the model is still loading" if slot.index == 0 else
                          f"slot {slot.index} of this worker serves no model now")
    return slot.runtime


def authorize(request: Request) -> None:
    """With a worker token set, only its holder (the coordinator, a scraper given it) may use any
    route but health (see the module docstring)."""
    token = request.app.state.settings.worker_token
    if token and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                         f"Bearer {token}".encode()):
        raise WorkerError(reasons.UNAUTHORIZED, "this worker needs the worker token")


# `response_class=Response` (no media type) keeps FastAPI from listing `application/json` for 200.
@router.post(GENERATE_PATH, response_class=Response, responses=_generate_responses(),
          openapi_extra={"parameters": _generate_headers(), "requestBody": _ONE_OF_PROMPT_OR_MESSAGES})
async def generate(body: GenerateRequest, request: Request) -> Response:
    settings = slot_of(request).settings
    request_id = request.state.request_id = request_id_of(request)
    authorize(request)
    _check_protocol(request)
    expected = request.headers.get(SESSION_EXPECTED_HEADER, "") == "1"
    stream_ref = _stream_ref(request)
    metrics: WorkerMetrics = request.app.state.metrics
    trace = tracing.begin(getattr(request.app.state, "tracing", None), "worker generate", request.headers, {
        "llm_pool.request_id": request_id, "llm_pool.worker": settings.worker_id, "llm_pool.tenant": body.tenant})
    try:  # only this route's refusals are admission decisions
        runtime = runtime_of(request)
        ticket = runtime.gate.check(body, session_expected=expected)
    except WorkerError as refused:
        metrics.admission.labels("rejected", refused.reason).inc()
        trace.fail(refused.reason)
        trace.end()
        raise
    if body.keep_alive is not None:  # Ollama's: only lengthens the model's stay, for this tenant, within a bound
        runtime.asked_keep_alive(body.tenant, body.keep_alive)
    if (given := trace.traceparent()) is not None:  # traced: a peer's prefix export joins this trace
        ticket = dataclasses.replace(ticket, traceparent=given)
    # The head goes now, and pings while the prompt is prepared: silence means a hung worker, never
    # a long prompt (protocol.worker.AdmittedEvent).
    headers = {REQUEST_ID_HEADER: request_id, WORKER_ID_HEADER: settings.worker_id}
    return EventStream(_events(runtime, ticket, request_id, stream_ref, trace), headers=headers,
                       ping_interval=PING_INTERVAL, send_timeout=settings.slow_consumer_deadline)

_EMBED_REFUSALS: dict[int | str, str] = {
    400: "`invalid_request` (also `dimensions` other than the model's, or an input with no tokens), "
         "`protocol_mismatch`, or `embeddings_unsupported`: this worker does not serve embeddings",
    401: _UNAUTHORIZED_TEXT,
    404: "`unknown_model`",
    413: "`prompt_too_long`: an input longer than the embedding context (never cut), or `body_too_large`",
    500: "`engine_failed`: the embedding context failed (its log says why)",
    503: "`loading`, `draining`, or `embeddings_full` (its bounded queue), with Retry-After",
    504: "`deadline_exceeded`: not embedded within --embedding-timeout",
    "4XX": "any other refusal (`request_timeout`, `headers_too_large`, an unknown method)",
}


@router.post(EMBED_PATH, response_model=EmbedResponse, openapi_extra={"parameters": _generate_headers()[:2]},
             responses={status: {"model": ErrorBody, "description": text}
                        for status, text in _EMBED_REFUSALS.items()})
async def embed(body: EmbedRequest, request: Request) -> JSONResponse:
    """One vector per input, computed by the embedder's own thread and llama.cpp context: never in the
    decode loop's batch, and never on the event loop."""
    settings = slot_of(request).settings
    request_id = request.state.request_id = request_id_of(request)
    authorize(request)
    _check_protocol(request)
    metrics: WorkerMetrics = request.app.state.metrics
    with tracing.span(getattr(request.app.state, "tracing", None), "worker embed", request.headers, {
            "llm_pool.request_id": request_id, "llm_pool.worker": settings.worker_id, "llm_pool.tenant": body.tenant,
            "llm_pool.inputs": len(body.inputs)}) as trace:  # ended with the block, in error with its reason
        try:
            runtime = runtime_of(request)
            try:
                embedded = await runtime.gate.embed(body)
            finally:
                runtime.used(body.tenant)
        except WorkerError as refused:
            metrics.embedding_requests.labels(refused.reason).inc()  # counted, not logged, as generation's refusals
            raise
        trace.set({"llm_pool.tokens": sum(embedded.tokens)})
    metrics.embedding_requests.labels("ok").inc()
    log.info(json.dumps({"event": "embedding", "request_id": request_id, "worker_id": settings.worker_id,
                         "tenant": body.tenant, "inputs": len(body.inputs), "tokens": sum(embedded.tokens),
                         "status": 200, **({"trace_id": trace.trace_id} if trace.trace_id else {})}))
    answer = EmbedResponse(model=runtime.names.name, dimensions=embedded.dimensions,
                           embeddings=embedded.vectors, prompt_tokens=embedded.tokens, request_id=request_id,
                           worker_id=settings.worker_id)
    return JSONResponse(answer.model_dump(), headers={REQUEST_ID_HEADER: request_id,
                                                      WORKER_ID_HEADER: settings.worker_id})


# Open even with a worker token: probes cannot send one (see the module docstring).
@router.get(HEALTH_PATH)
async def health(request: Request) -> JSONResponse:
    slot = slot_of(request)
    settings, runtime = slot.settings, slot.runtime
    if runtime is None and (slot.standby is not None or slot.index == 0 and beating(slots_of(request.app))):
        # Alive and well with no model loaded here (another slot may serve one, or beat in standby):
        # a liveness probe of the worker's own URL must not restart it.
        standby = slot.standby.names.name if slot.standby is not None else ""
        body = WorkerHealth(status="standby", worker_id=settings.worker_id, model=standby)
        return JSONResponse(body.model_dump(), status_code=200)
    if runtime is None and slot.index > 0:
        raise WorkerError(reasons.UNKNOWN_MODEL, f"slot {slot.index} of this worker serves no model now")
    if runtime is None:
        body = WorkerHealth(status="loading", worker_id=settings.worker_id, model=settings.model_path.stem)
        return JSONResponse(body.model_dump(), status_code=503)
    status: Literal["ok", "draining"] = "draining" if runtime.gate.draining else "ok"
    body = WorkerHealth(status=status, worker_id=settings.worker_id, model=runtime.names.name,
                        aliases=list(runtime.names.aliases), load=runtime.load(),
                        embeddings=runtime.embedding_service(), batch_steps=runtime.engine.steps)
    # Draining: not ready for new work (a readiness probe or load balancer moves away).
    return JSONResponse(body.model_dump(), status_code=503 if runtime.gate.draining else 200)

@router.get(SESSIONS_PATH, responses={401: _UNAUTHORIZED,
                                        503: {"model": ErrorBody, "description": "`loading`"}})
async def sessions(request: Request) -> SessionList:
    authorize(request)
    runtime = runtime_of(request)
    runtime.handed_over()
    return SessionList(ttl_seconds=runtime.table.ttl, sessions=runtime.table.describe())

@router.delete(SESSIONS_PATH + "/{session_id}", status_code=204, responses={
    400: {"model": ErrorBody, "description": "`invalid_request`: a malformed tenant"},
    401: _UNAUTHORIZED,
    404: {"model": ErrorBody, "description": "`unknown_session`: this tenant holds no session of that id "
                                             "(another tenant's session of the same id is left alone)"},
    503: {"model": ErrorBody, "description": "`loading`"}})
async def delete_session(session_id: str, request: Request,
                         tenant: str = Query("", pattern=TENANT_PATTERN,
                                             description="the tenant whose session it is (`GenerateRequest."
                                                         "tenant`); \"\" when the pool has no keys")) -> Response:
    authorize(request)
    runtime = runtime_of(request)
    runtime.handed_over()
    session = runtime.table.delete(session_id, tenant=tenant)
    if session.busy:
        # Its stream is cancelled now; the engine frees the sequence at its next step.
        runtime.table.mark_ending(session)
        runtime.engine.cancel_session(session)
    else:
        runtime.engine.free([session.seq_id])
    return Response(status_code=204)

@router.get("/metrics", response_class=PlainTextResponse, responses={401: _UNAUTHORIZED})
async def metrics(request: Request) -> Response:
    authorize(request)
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")



def _check_protocol(request: Request) -> None:
    version = request.headers.get(PROTOCOL_HEADER, str(PROTOCOL_VERSION))
    if version != str(PROTOCOL_VERSION):
        raise WorkerError(reasons.PROTOCOL_MISMATCH,
                          f"this worker speaks protocol {PROTOCOL_VERSION}, the request is version {version}")


def _stream_ref(request: Request) -> int | None:
    given = request.headers.get(STREAM_REF_HEADER)
    if given is None:
        return None
    if not (given.isascii() and given.isdigit() and len(given) <= 19 and int(given) <= MAX_STREAM_REF):
        raise WorkerError(reasons.INVALID_REQUEST, f"{STREAM_REF_HEADER} must be an integer below 2**63")
    return int(given)


def request_id_of(request: Request) -> str:
    """The coordinator's id for the request, when it is one (it goes into headers and logs); else a new one."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


async def _events(runtime: WorkerRuntime, ticket: Ticket, request_id: str,
                  stream_ref: int | None, trace: Trace = NO_TRACE) -> AsyncGenerator[bytes, None]:
    """The SSE events of one request: `admitted` (or the refusal's `error`), then its job's. If the
    client goes away, the job is cancelled and its KV freed."""
    try:
        with trace.step("admission"):  # tokenizing, the wait in line, the session and KV reserved
            job = await runtime.gate.prepare(ticket, request_id, stream_ref=stream_ref)
    except WorkerError as refused:
        # Counted, not logged, as a refusal by status is: under load they come by the thousand.
        runtime.metrics.admission.labels("rejected", refused.reason).inc()
        trace.fail(refused.reason)
        trace.end()
        yield encode(EVENT_ERROR, ErrorEvent(error=refused.message, reason=refused.reason,
                                             request_id=request_id).model_dump_json())
        return
    runtime.metrics.admission.labels("admitted", "").inc()
    outcome: Finished | Failed | None = None
    runtime.jobs.add(job)
    probabilities = job.request.probabilities
    try:
        yield encode(EVENT_ADMITTED, AdmittedEvent(prompt_tokens=job.prompt_length).model_dump_json())
        while outcome is None:
            # Everything the channel holds goes out in one write: a stream the event loop reaches
            # late (the engine wakes it at most once a step) sends its tokens as one chunk.
            chunks: list[bytes] = []
            for item in await job.channel.get_all():
                if isinstance(item, (Finished, Failed)):
                    outcome = item
                chunks.append(_item_events(runtime, job, item, probabilities))
                if outcome is not None:
                    break
            yield b"".join(chunks)
    finally:
        runtime.jobs.discard(job)
        runtime.used(ticket.request.tenant)
        runtime.gate.ended(ticket.request)
        if outcome is None:
            job.channel.cancel()
            for session in job.sessions:
                runtime.table.mark_ending(session)
            runtime.engine.poke()
        _log_request(runtime, job, outcome, trace.trace_id)
        _trace_end(trace, runtime, job, outcome)


def _item_events(runtime: WorkerRuntime, job: Job, item: StreamItem, probabilities: bool) -> bytes:
    """One channel item as the SSE events the client reads (a scored prompt's may be several)."""
    if isinstance(item, Finished):
        return encode(EVENT_DONE, _done(runtime, job, item).model_dump_json())
    if isinstance(item, Failed):
        error = ErrorEvent(error=item.message, reason=item.reason, request_id=job.request_id)
        return encode(EVENT_ERROR, error.model_dump_json())
    if isinstance(item, PromptScored):
        parts = [slice(start, start + PROMPT_EVENT_TOKENS) for start in range(0, len(item.tokens), PROMPT_EVENT_TOKENS)]
        return b"".join(encode(EVENT_PROMPT, PromptEvent(start=part.start, tokens=item.tokens[part],
                                                         logprobs=item.logprobs[part], top=item.top[part]
                                                         ).model_dump_json()) for part in parts)
    return token_event(item.text, item.index, item.probability if probabilities else None, item.choice,
                       item.alternatives, item.ids)


def _done(runtime: WorkerRuntime, job: Job, item: Finished) -> DoneEvent:
    decode_s = item.total_s - item.ttft_s
    # After each choice's first token generated here (a continuation's earlier tokens were generated elsewhere).
    later = item.completion_tokens - job.continued - max(1, len(item.choices))
    tps = later / decode_s if later > 0 and decode_s > 0 else 0.0
    return DoneEvent(
        finish_reason=item.reason,  # type: ignore[arg-type]
        usage=Usage(prompt_tokens=item.prompt_tokens, cached_tokens=item.cached_tokens,
                    completion_tokens=item.completion_tokens,
                    total_tokens=item.prompt_tokens + item.completion_tokens),
        timings=Timings(queue_ms=item.queue_s * 1e3, prefill_ms=item.prefill_s * 1e3, ttft_ms=item.ttft_s * 1e3,
                        total_ms=item.total_s * 1e3, tokens_per_second=tps),
        request_id=job.request_id, worker_id=runtime.settings.worker_id, model=runtime.names.name,
        session_id=job.request.session_id,
        choices=[ChoiceEnd(finish_reason=end.reason, completion_tokens=end.completion_tokens)  # type: ignore[arg-type]
                 for end in item.choices] or None)


def _trace_end(trace: Trace, runtime: WorkerRuntime, job: Job, outcome: Finished | Failed | None) -> None:
    """The request's span, with the engine's steps written as its children (their times are the
    engine's own, on the gate's clock: placed on the wall clock from now)."""
    if trace is NO_TRACE:
        return
    if isinstance(outcome, Finished):
        admitted_ns = time.time_ns() - int((runtime.gate.clock() - job.admitted_at) * 1e9)

        def at(seconds: float) -> int:
            return admitted_ns + int(seconds * 1e9)

        trace.record("queue", at(0.0), at(outcome.queue_s))
        trace.record("prefill", at(outcome.queue_s), at(outcome.ttft_s),
                     {"llm_pool.prompt_tokens": outcome.prompt_tokens, "llm_pool.cached_tokens": outcome.cached_tokens,
                      "llm_pool.copied_tokens": job.copied_tokens})
        trace.record("decode", at(outcome.ttft_s), at(outcome.total_s),
                     {"llm_pool.completion_tokens": outcome.completion_tokens})
        trace.set({"llm_pool.finish_reason": outcome.reason})
    else:
        trace.fail(outcome.reason if outcome is not None else "client_gone")
    trace.end()


def _log_request(runtime: WorkerRuntime, job: Job, outcome: Finished | Failed | None, trace_id: str = "") -> None:
    line: dict[str, object] = {"event": "request", "request_id": job.request_id,
                               "worker_id": runtime.settings.worker_id, "model": runtime.names.name,
                               "session_id": job.request.session_id, "tenant": job.request.tenant,
                               "prompt_tokens": job.prompt_length}
    if job.continued:
        line["continued_tokens"] = job.continued
    if isinstance(outcome, Finished):
        line.update(finish_reason=outcome.reason, cached_tokens=outcome.cached_tokens,
                    completion_tokens=outcome.completion_tokens, ttft_ms=round(outcome.ttft_s * 1e3, 2),
                    duration_ms=round(outcome.total_s * 1e3, 2))
    elif isinstance(outcome, Failed):
        line.update(finish_reason="error", reason=outcome.reason)
    else:
        line.update(finish_reason="client_gone")
    if trace_id:
        line["trace_id"] = trace_id
    log.info(json.dumps(line))
