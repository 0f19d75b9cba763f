"""Big prompts against the real pool: refused at the coordinator's edge before any worker tokenizes them.

Before: four concurrent 3 MB chat bodies (1,024 messages of 3,000 characters) each cost a worker about
1.4 s of tokenizing before its 413, both workers went silent past the coordinator's read timeout, both
breakers opened, and legitimate requests got 502."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.model
HOSTILE = {"max_tokens": 8, "messages": [{"role": "user", "content": "x" * 3_000} for _ in range(1_024)]}


def test_each_worker_reports_the_longest_prompt_that_can_fit(cluster: Cluster) -> None:
    for worker_id in cluster.workers:
        load = cluster.worker_load(worker_id)
        # session_max_tokens x the vocabulary's longest token in bytes: at least one byte a token
        assert load["max_prompt_bytes"] >= load["session_max_tokens"] > 0


@pytest.mark.anyio
async def test_six_3_mb_chat_bodies_are_refused_at_once_beside_normal_streams(cluster: Cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as client:

        async def hostile() -> tuple[int, float]:
            started = time.monotonic()
            response = await client.post("/v1/chat/completions", json=HOSTILE)
            return response.status_code, time.monotonic() - started

        async def normal(i: int) -> int:
            response = await client.post("/coordinator/infer", json={"prompt": f"Count to {i}.", "max_tokens": 16})
            return response.status_code if '"finished":true' in response.text else -1

        results = await asyncio.gather(*(hostile() for _ in range(6)), *(normal(i) for i in range(2)))
        states = (await client.get("/coordinator/health/workers")).json()["workers"]
    refusals, served = results[:6], results[6:]
    assert all(status == 400 for status, _ in refusals), refusals  # OpenAI's context_length_exceeded
    assert max(took for _, took in refusals) < 1.0, refusals
    assert served == [200, 200]
    assert {w["breaker"] for w in states} == {"closed"}
