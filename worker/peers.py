"""Asking a peer worker for the cells of a prompt's prefix (`GenerateRequest.prefix_peer`).

Owns: the HTTP call (`POST /worker/prefix` on the peer, with the pool's worker token), its bounds (the
answer at most `kv_transfer_max_bytes`, the whole call within `peer_prefix_timeout`) and turning every
failure into "no prefix": the request is then prefilled here, as it would have been without the hint.
Must not: check or write the cells (worker/admission.py unpacks the blob and the engine writes it).
"""

from __future__ import annotations

import asyncio

import httpx

from protocol.worker import PREFIX_PATH, PrefixRequest
from serving.tracing import TRACEPARENT
from worker.metrics import WorkerMetrics


class HttpPeers:
    def __init__(self, *, token: str | None, min_tokens: int, timeout: float, max_bytes: int,
                 metrics: WorkerMetrics) -> None:
        self.min_tokens = min_tokens
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self._max_bytes = max_bytes
        self._metrics = metrics
        self._client: httpx.AsyncClient | None = None

    def open(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """Inside the running loop (the client's pool belongs to it)."""
        self._client = httpx.AsyncClient(transport=transport, timeout=self.timeout, headers=self._headers,
                                         follow_redirects=False, trust_env=False)

    async def fetch(self, url: str, tokens: list[int], tenant: str, at_least: int,
                    traceparent: str | None = None) -> bytes | None:
        if self._client is None:
            return None
        body = PrefixRequest(tokens=tokens, tenant=tenant, at_least=at_least).model_dump_json()
        outcome, blob = "failed", None
        try:
            async with asyncio.timeout(self.timeout), self._client.stream(
                    "POST", url.rstrip("/") + PREFIX_PATH, content=body,
                    headers={"content-type": "application/json",
                             **({TRACEPARENT: traceparent} if traceparent else {})}) as response:
                if response.status_code != 200:
                    outcome = "none"
                else:
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > self._max_bytes:
                            break
                        chunks.append(chunk)
                    else:
                        outcome, blob = "ok", b"".join(chunks)
        except (httpx.HTTPError, TimeoutError):
            pass
        self._metrics.kv_moved("peer_prefix", outcome, len(blob or b""))
        return blob

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
