"""Dispatch of one embedding request: `POST /worker/embed` to the ranked workers until one answers.

Owns: the HTTP call (protocol.worker's `EmbedRequest` and `EmbedResponse`), failover (bounded
attempts, as for generation), the embedding slot held per attempt and given back once its answer is
read, the whole request's deadline (`--embedding-timeout`, shared by its attempts), checking that
an answer has one vector of the announced size per input, and what each attempt tells the breakers.
Must not: rank workers (scheduling/) or know a public wire format (surfaces/embeddings.py).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from coordinator.admission.embeddings import EmbeddingAdmission
from coordinator.embedding import Embedding
from coordinator.errors import CoordinatorError
from coordinator.metrics import CoordinatorMetrics
from coordinator.pool.breaker import Breakers
from coordinator.pool.registry import WorkerRecord
from coordinator.relay.dispatch import Failover, judge_failover, worker_refusal
from coordinator.upstream import (
    WorkerClient,
    WorkerResponse,
    WorkerStreamError,
    WorkerUnreachable,
)
from protocol import reasons
from protocol.worker import EMBED_PATH, PROTOCOL_HEADER, PROTOCOL_VERSION, REQUEST_ID_HEADER, EmbedResponse


@dataclass(frozen=True, slots=True)
class EmbedAnswer:
    response: EmbedResponse
    attempts: int


class EmbeddingDispatcher:
    def __init__(self, client: WorkerClient, admission: EmbeddingAdmission, metrics: CoordinatorMetrics,
                 breakers: Breakers, *, max_attempts: int, timeout: float, now: Callable[[], float],
                 retry_after: int, worker_token: str | None = None) -> None:
        self._client = client
        self._admission = admission
        self._metrics = metrics
        self._breakers = breakers
        self._max_attempts = max_attempts
        self._timeout = timeout
        self._now = now
        self._retry_after = retry_after
        self._auth = {"authorization": f"Bearer {worker_token}"} if worker_token else {}

    async def embed(self, work: Embedding, ranked: Sequence[WorkerRecord], *,
                    reserved: Callable[[], None] | None = None) -> EmbedAnswer:
        """`reserved` runs once, when the first attempt's slot is held (before any await)."""
        deadline = self._now() + self._timeout
        last: Failover | None = None
        refused_only = True
        for attempt, worker in enumerate(ranked[: self._max_attempts], start=1):
            left = deadline - self._now()
            if left <= 0:
                break
            slot = self._admission.reserve(worker)
            if reserved is not None:
                reserved()
                reserved = None
            self._breakers.attempt(worker)
            try:
                response = await self._attempt(worker, work, left)
            except Failover as failover:
                judge_failover(failover, worker.worker_id, work.request_id, self._breakers, self._metrics,
                               embeddings=True)
                last, refused_only = failover, refused_only and failover.refused
                continue
            except BaseException:
                self._breakers.settled(worker.worker_id)
                raise
            finally:
                self._admission.release(slot)
            self._breakers.succeeded(worker.worker_id)
            return EmbedAnswer(response, attempt)
        if self._now() >= deadline:
            raise CoordinatorError(reasons.DEADLINE_EXCEEDED, f"not embedded within {self._timeout:g} s "
                                   f"({last.reason if last else 'no worker answered'})")
        if last is not None and refused_only:
            raise CoordinatorError(last.reason, f"every eligible worker refused: {last.reason}",
                                   retry_after=last.retry_after or self._retry_after)
        raise CoordinatorError(reasons.WORKER_UNAVAILABLE,
                               f"no worker could embed the request ({last.reason if last else 'none tried'})")

    async def _attempt(self, worker: WorkerRecord, work: Embedding, left: float) -> EmbedResponse:
        url = worker.url.rstrip("/") + EMBED_PATH
        headers = {"content-type": "application/json", REQUEST_ID_HEADER: work.request_id,
                   PROTOCOL_HEADER: str(PROTOCOL_VERSION)} | self._auth
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
