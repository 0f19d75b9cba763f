"""Dispatch of one tokenizer request to one worker: `POST /worker/tokenize`, `/worker/detokenize` or
`/worker/tokenizer_info` (protocol.worker), and its answer checked.

Owns: the HTTP call within WORKER_READ_TIMEOUT, and checking the answer against the type the worker's
route answers (protocol/tokens.py), which then goes to the client as it came.
Must not: choose or judge workers (coordinator/tokenizing.py chooses them, attempts.Tries tries them in
turn and judges), or know a public body (surfaces/tokenizer.py).

A worker's refusals mean what they mean for generation (`dispatch.worker_refusal`): its 4xx goes to
the client with its reason; a 503, a 5xx, a 401 or no answer moves on to the next worker, and so
does an answer that is not the route's type.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from coordinator.pool.registry import WorkerRecord
from coordinator.relay.dispatch import Failover, worker_refusal
from coordinator.upstream import WorkerClient, WorkerStreamError, WorkerUnreachable
from protocol import reasons
from protocol.worker import PROTOCOL_HEADER, PROTOCOL_VERSION, REQUEST_ID_HEADER
from serving.tracing import TRACEPARENT


class TokenizerDispatcher:
    def __init__(self, client: WorkerClient, *, read_timeout: float) -> None:
        """`client` carries the worker token (upstream.with_token)."""
        self._client = client
        self._read_timeout = read_timeout

    async def ask(self, worker: WorkerRecord, path: str, payload: bytes, answer: type[BaseModel], *,
                  request_id: str, traceparent: str | None = None) -> dict[str, Any]:
        """`payload` posted to `worker`'s `path`: its answer, checked as an `answer`, or the `Failover` or
        `CoordinatorError` that says why not."""
        headers = {"content-type": "application/json", REQUEST_ID_HEADER: request_id,
                   PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
        if traceparent is not None:
            headers[TRACEPARENT] = traceparent
        try:
            response = await self._client.post(worker.url.rstrip("/") + path, payload, headers,
                                               read_timeout=self._read_timeout)
        except WorkerUnreachable as exc:
            raise Failover(reasons.WORKER_UNAVAILABLE, refused=False) from exc
        try:
            if response.status != 200:
                raise await worker_refusal(response)
            body = await response.read()
        except WorkerStreamError as exc:
            raise Failover(reasons.WORKER_FAILED, refused=False) from exc
        finally:
            await response.close()
        try:
            return answer.model_validate_json(body).model_dump()
        except ValidationError as exc:
            raise Failover(reasons.WORKER_FAILED, refused=False) from exc
