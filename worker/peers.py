"""Asking a peer worker for the cells of a prompt's prefix (`GenerateRequest.prefix_peer`).

Owns: the HTTP call (`POST /worker/prefix` on the peer, with the pool's worker token), asked again while
the peer answers 503 (its transfer slots busy), its bounds (the answer at most `kv_transfer_max_bytes`,
every ask within `peer_prefix_timeout`) and turning every failure into "no prefix": the request is then
prefilled here, as it would have been without the hint.
Must not: check or write the cells (worker/admission.py unpacks the blob and the engine writes it).
"""

from __future__ import annotations

import asyncio

import httpx

from protocol.worker import PREFIX_PATH, PrefixRequest
from serving.tracing import TRACEPARENT
from worker.metrics import WorkerMetrics

BUSY = object()  # a peer's answer while its transfer slots are all taken (503), asked again after BUSY_RETRY
BUSY_RETRY = 0.05  # seconds; every ask stays within the fetch's `timeout`


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
            async with asyncio.timeout(self.timeout):
                while (answer := await self._ask(url, body, traceparent)) is BUSY:
                    await asyncio.sleep(BUSY_RETRY)  # its transfer slots are taken: one frees in a moment
                outcome, blob = ("ok", answer) if isinstance(answer, bytes) else ("none", None)
        except (httpx.HTTPError, TimeoutError):
            pass
        self._metrics.kv_moved("peer_prefix", outcome, len(blob or b""))
        return blob

    async def _ask(self, url: str, body: str, traceparent: str | None) -> bytes | object | None:
        """One ask: the cells' blob, BUSY (503: the peer's transfer slots are all taken, which frees in a
        moment, as when several streams move off a draining worker at once), or None (it holds no such
        prefix, or the blob is over the bound)."""
        assert self._client is not None
        async with self._client.stream("POST", url.rstrip("/") + PREFIX_PATH, content=body,
                                       headers={"content-type": "application/json",
                                                **({TRACEPARENT: traceparent} if traceparent else {})}) as response:
            if response.status_code == 503:
                return BUSY
            if response.status_code != 200:
                return None
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self._max_bytes:
                    return None
                chunks.append(chunk)
            return b"".join(chunks)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
