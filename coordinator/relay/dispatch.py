"""Dispatch: one admitted request sent to one worker, up to the worker's first token.

Owns: the HTTP call to `POST /worker/generate` (protocol.worker) up to the worker's first token, the
`admitted` event passed on (`admitted(prompt tokens)`: the reservation's owner confirms it), and
turning what the worker answered into a `Failover` (503 refusals, unreachable or failing workers: the
next worker may serve it) or a `CoordinatorError` (400/404/409/413 pass through with the worker's
reason).
Must not: hold reservations or judge workers (coordinator/attempts.py tries the ranked workers in
turn and does both), relay events after the first one (stream.py) or rank workers (scheduling/).

The client's status line waits for the worker's first token, not just its headers, so a worker that
dies during prefill is still failed over: no byte has reached the client yet.

Who is at fault for a wait: a worker answers its head at once and pings every second after, so no
head within `worker_read_timeout`, or that long a silence, is a hung worker (a failure: its breaker
counts it). `worker_first_event_timeout` passing while it pings is not: before `admitted` the request
waited on its own preparation (the worker's tokenizers' queue), a refusal like a full worker's, tried
on the next one; after `admitted`, an engine that took that long for one first token is failing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from coordinator.admission.capacity import Reservation
from coordinator.errors import STATUS_BY_REASON, CoordinatorError
from coordinator.generation import Generation
from coordinator.pool.registry import WorkerRecord
from coordinator.upstream import (
    WorkerClient,
    WorkerResponse,
    WorkerStreamError,
    WorkerUnreachable,
)
from protocol import reasons
from protocol.sse import SseEvent, SseParser, SseTooLarge
from protocol.worker import (
    EVENT_ADMITTED,
    EVENT_ERROR,
    GENERATE_PATH,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    REQUEST_ID_HEADER,
    SESSION_EXPECTED_HEADER,
    STREAM_REF_HEADER,
    AdmittedEvent,
    ErrorBody,
    ErrorEvent,
)
from serving.tracing import TRACEPARENT

log = logging.getLogger("coordinator.requests")


class Failover(Exception):
    """This worker cannot serve the request, and another may: try the next one (relay/embeddings.py and
    relay/tokens.py too)."""

    def __init__(self, reason: str, refused: bool, retry_after: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused  # True: the worker said 503; False: it failed or could not be reached
        self.retry_after = retry_after


@dataclass(slots=True)
class OpenStream:
    worker: WorkerRecord
    response: WorkerResponse
    events: AsyncIterator[SseEvent]
    first: SseEvent
    reservation: Reservation
    attempts: int
    prompt_tokens: int | None = None  # the prompt's length as the worker admitted it (AdmittedEvent)

    async def close(self) -> None:
        """Closing the response closes the connection, which cancels the request on the worker."""
        await self.response.close()


async def worker_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[SseEvent]:
    """The events in a worker's body; a broken body or an oversized event is a `WorkerStreamError`."""
    parser = SseParser()
    try:
        async for chunk in chunks:
            for event in parser.feed(chunk):
                yield event
    except SseTooLarge as exc:
        raise WorkerStreamError(f"{type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class PrefixPeer:
    """The worker that was sent most of a prompt's prefix (the prefix index's guess), and how much."""

    worker_id: str
    url: str
    share: float  # of the prompt's indexed blocks
    shares: Mapping[str, float]  # every worker's share

    def fragment_for(self, worker_id: str) -> bytes:
        """The hint as `worker_id` gets it: only when the peer was sent more of the prefix."""
        if worker_id == self.worker_id or self.shares.get(worker_id, 0.0) >= self.share:
            return b""
        return b',"prefix_peer":' + json.dumps(self.url).encode()


@dataclass(frozen=True, slots=True)
class PrefixHints:
    """What the coordinator adds to a request for the worker it tries: the prompt's prefix blocks (the
    worker lists them in its heartbeats while its cells hold that prompt: every coordinator's prefix
    index learns where it went) and, for a worker that was sent less of the prefix, the peer."""

    blocks: bytes = b""  # ',"prefix_blocks":[...]', or nothing
    peer: PrefixPeer | None = None

    @classmethod
    def of(cls, hashes: Sequence[bytes], peer: PrefixPeer | None) -> PrefixHints:
        blocks = b',"prefix_blocks":' + json.dumps([h.hex() for h in hashes]).encode() if hashes else b""
        return cls(blocks, peer)

    def payload_for(self, worker_id: str, valid: Generation) -> bytes:
        """The request as `worker_id` gets it. The payload is one JSON object of the fields the client
        set: the hints go in as more fields."""
        extra = self.blocks + (self.peer.fragment_for(worker_id) if self.peer is not None else b"")
        return valid.payload[:-1] + extra + b"}" if extra else valid.payload


class Dispatcher:
    def __init__(self, client: WorkerClient, *, first_event_timeout: float) -> None:
        """`client` carries the worker token (upstream.with_token)."""
        self._client = client
        self._first_event_timeout = first_event_timeout

    async def start(self, worker: WorkerRecord, valid: Generation, res: Reservation, hints: PrefixHints | None,
                    *, admitted: Callable[[int], None], traceparent: str | None = None) -> OpenStream:
        """The request started on `worker` up to its first token (reserved as `res`), or the `Failover`
        or `CoordinatorError` that says why not; `admitted` gets the prompt's length in tokens.
        `traceparent`: the attempt's span, sent on to the worker (W3C trace context)."""
        started = _Started()
        try:
            async with asyncio.timeout(self._first_event_timeout):
                await self._start(worker, valid, res, hints, started, admitted, traceparent)
        except BaseException as exc:
            if started.response is not None:
                await started.response.close()
            failover = _failover_for(exc, started)
            if failover is None:
                raise
            raise failover from exc
        response, events, first = started.response, started.events, started.first
        assert response is not None and events is not None
        if first is None or first.event in (EVENT_ERROR, EVENT_ADMITTED) or not started.admitted:
            # Nothing reached the client yet, so another worker may still serve it.
            await response.close()
            raise Failover(reasons.WORKER_FAILED, refused=False)
        return OpenStream(worker, response, events, first, res, attempts=1, prompt_tokens=started.prompt_tokens)

    async def _start(self, worker: WorkerRecord, valid: Generation, res: Reservation, hints: PrefixHints | None,
                     started: _Started, admitted: Callable[[int], None], traceparent: str | None) -> None:
        """Posts the request and reads up to its first token, noting each step in `started`."""
        body = valid.payload if hints is None else hints.payload_for(worker.worker_id, valid)
        headers = _worker_headers(valid, res)
        if traceparent is not None:
            headers[TRACEPARENT] = traceparent
        response = await self._client.post(worker.url.rstrip("/") + GENERATE_PATH, body, headers)
        started.response = response
        if response.status != 200:
            raise await worker_refusal(response)
        started.events = events = worker_events(response.chunks())
        first = await anext(events, None)
        if first is not None and first.event == EVENT_ADMITTED:
            started.prompt_tokens = AdmittedEvent.model_validate_json(first.data).prompt_tokens
            admitted(started.prompt_tokens)
            started.admitted = True
            first = await anext(events, None)
        elif first is not None and first.event == EVENT_ERROR:
            raise _refused_in_stream(first)  # refused while preparing: nothing ran
        started.first = first


@dataclass(slots=True)
class _Started:
    """How far an attempt got: the worker's answer, its events, whether it admitted the request."""

    response: WorkerResponse | None = None
    events: AsyncIterator[SseEvent] | None = None
    first: SseEvent | None = None
    admitted: bool = False
    prompt_tokens: int | None = None


def _failover_for(exc: BaseException, started: _Started) -> Failover | None:
    """What an attempt that raised `exc` means for the next worker; None: `exc` stands as it is (a
    refusal already decided, a cancel)."""
    answered = started.response is not None
    if isinstance(exc, TimeoutError) and answered and not started.admitted:
        # The worker answered and kept pinging while it prepared the prompt (its tokenizers' queue, a
        # release it waited for): this request's own wait, no verdict on the worker.
        return Failover(reasons.QUEUE_TIMEOUT, refused=True)
    if isinstance(exc, (WorkerUnreachable, WorkerStreamError, ValidationError, TimeoutError)):
        return Failover(reasons.WORKER_FAILED if answered else reasons.WORKER_UNAVAILABLE, refused=False)
    return None


async def worker_refusal(response: WorkerResponse) -> Exception:
    """What a worker's non-200 answer means: `Failover` (503 or a retryable reason, a 5xx, a 401:
    try the next worker) or the `CoordinatorError` to answer with (the worker's 4xx and reason)."""
    raw = await response.read()
    await response.close()
    try:
        body = ErrorBody.model_validate_json(raw)
    except ValidationError:
        return Failover(reasons.WORKER_FAILED, refused=False)
    if response.status == 503 or body.reason in reasons.RETRYABLE_ON_OTHER_WORKER:
        return Failover(body.reason, refused=True, retry_after=_int_header(response, "retry-after"))
    if response.status >= 500 or response.status == 401:
        # 401: the worker wants another worker token than ours. Not the client's fault, and
        # perhaps only this worker's: a misconfigured worker, tried like a failing one.
        return Failover(body.reason, refused=False)
    return CoordinatorError(body.reason, body.error, status=response.status)


def _refused_in_stream(event: SseEvent) -> Exception:
    """An `error` event in place of `admitted`: the worker refused what it found preparing the prompt,
    with the reason a status would have named (protocol.worker.AdmittedEvent)."""
    error = ErrorEvent.model_validate_json(event.data)
    if error.reason in reasons.RETRYABLE_ON_OTHER_WORKER:
        return Failover(error.reason, refused=True)
    status = STATUS_BY_REASON.get(error.reason, 502)
    if 400 <= status < 500:
        return CoordinatorError(error.reason, error.error)
    return Failover(reasons.WORKER_FAILED, refused=False)


def _int_header(response: WorkerResponse, name: str) -> int | None:
    value = response.header(name) or ""
    return int(value) if value.isdigit() else None


_PROTOCOL = str(PROTOCOL_VERSION)


def _worker_headers(valid: Generation, res: Reservation) -> dict[str, str]:
    headers = {"content-type": "application/json", REQUEST_ID_HEADER: valid.request_id,
               PROTOCOL_HEADER: _PROTOCOL, STREAM_REF_HEADER: str(res.key)}
    if valid.request.session_id is not None and not valid.demand.new_session:
        headers[SESSION_EXPECTED_HEADER] = "1"  # affinity: the worker must already hold this session
    return headers
