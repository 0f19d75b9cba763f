"""Dispatch of one embedding request to one worker: `POST /worker/embed`, and its answer checked.

Owns: the HTTP call (protocol.worker's `EmbedRequest` and `EmbedResponse`), within what is left of the
request's deadline (`--embedding-timeout`, shared by its attempts), and checking that an answer has
one vector of the announced size per input.
Must not: hold embedding slots or judge workers (coordinator/attempts.py tries the ranked workers in
turn and does both), rank workers (scheduling/) or know a public wire format (surfaces/embeddings.py).

A worker's refusals mean what they mean for generation (`dispatch.worker_refusal`): its 4xx goes to
the client with its reason, a 503 or an unreachable worker moves on to the next one. A deadline is
not a failure: the worker's own (504 `deadline_exceeded`) or the request's (EMBEDDING_TIMEOUT) ends
the request with 504, no breaker verdict and no other worker tried. Before, the largest request the
pool accepts spent 30 s on each worker in turn, then answered 502 `worker_unavailable` though no
worker had failed (issue 33); a worker now refuses up front a request it cannot embed within its
deadline at the rate it measures (worker/engine/embedder.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pydantic import ValidationError

from coordinator.embedding import Embedding
from coordinator.errors import CoordinatorError
from coordinator.pool.registry import WorkerRecord
from coordinator.relay.dispatch import Failover, worker_refusal
from coordinator.upstream import (
    WorkerClient,
    WorkerResponse,
    WorkerStreamError,
    WorkerUnreachable,
)
from protocol import reasons
from protocol.worker import EMBED_PATH, PROTOCOL_HEADER, PROTOCOL_VERSION, REQUEST_ID_HEADER, EmbedResponse
from serving.tracing import TRACEPARENT


@dataclass(frozen=True, slots=True)
class EmbedAnswer:
    response: EmbedResponse
    attempts: int


class EmbeddingDispatcher:
    def __init__(self, client: WorkerClient, *, timeout: float) -> None:
        """`client` carries the worker token (upstream.with_token)."""
        self._client = client
        self._timeout = timeout

    async def send(self, worker: WorkerRecord, work: Embedding, left: float, *,
                   traceparent: str | None = None) -> EmbedResponse:
        """`work` embedded by `worker` within `left` seconds, or the `Failover` or `CoordinatorError` saying why not.
        `traceparent`: the attempt's span, sent on to the worker (W3C trace context)."""
        url = worker.url.rstrip("/") + EMBED_PATH
        headers = {"content-type": "application/json", REQUEST_ID_HEADER: work.request_id,
                   PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
        if traceparent is not None:
            headers[TRACEPARENT] = traceparent
        response: WorkerResponse | None = None
        try:
            async with asyncio.timeout(left):
                response = await self._client.post(url, work.payload, headers, read_timeout=left)
                if response.status != 200:
                    refusal = await worker_refusal(response)
                    if isinstance(refusal, Failover) and refusal.reason == reasons.DEADLINE_EXCEEDED:
                        raise CoordinatorError(reasons.DEADLINE_EXCEEDED, f"worker {worker.worker_id} did not embed "
                                               "it within its deadline (--embedding-timeout); not tried elsewhere, "
                                               "where it would wait as long (module docstring)")
                    raise refusal
                raw = await response.read()
        except TimeoutError:
            raise CoordinatorError(reasons.DEADLINE_EXCEEDED, f"not embedded within {self._timeout:g} s "
                                   "(EMBEDDING_TIMEOUT); no worker failed") from None
        except WorkerUnreachable as exc:
            raise Failover(reasons.WORKER_UNAVAILABLE, refused=False) from exc
        except WorkerStreamError as exc:
            raise Failover(reasons.WORKER_FAILED, refused=False) from exc
        finally:
            if response is not None:
                await response.close()  # read to its end: the connection goes back to the pool
        try:
            answer = EmbedResponse.model_validate_json(raw)
        except ValidationError as exc:
            raise Failover(reasons.WORKER_FAILED, refused=False) from exc
        if not _complete(answer, len(work.request.inputs)):
            raise Failover(reasons.WORKER_FAILED, refused=False)
        return answer


def _complete(answer: EmbedResponse, inputs: int) -> bool:
    """One vector per input, each the base64 of `dimensions` float32 values."""
    size = 4 * -(-answer.dimensions * 4 // 3)
    return (len(answer.embeddings) == len(answer.prompt_tokens) == inputs
            and all(len(vector) == size for vector in answer.embeddings))
