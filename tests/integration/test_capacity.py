"""Admission against real workers: 503 with the limit that ran out, and back to admitting after."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.integration.conftest import Cluster
from tests.integration.streams import Timed, infer, read_events
from tests.polling import wait_until

pytestmark = [pytest.mark.model, pytest.mark.anyio]


async def hold(client: httpx.AsyncClient, url: str, body: dict, opened: asyncio.Queue, release: asyncio.Event,  # type: ignore[type-arg]
               ) -> Timed:
    """Open a stream, report its first token, keep reading until told to hang up."""
    async with client.stream("POST", url + "/coordinator/infer", json=body) as response:
        timed = Timed(response.status_code, dict(response.headers))
        assert response.status_code == 200, await response.aread()
        reading = asyncio.create_task(read_events(response, timed))
        while "token" not in timed.names:
            # A stream that ends before its first token fails here, with what it said, not after 60 s.
            assert not reading.done(), f"stream ended before its first token: {timed.events}"
            await asyncio.sleep(0.01)
        await opened.put(timed)
        await release.wait()
        reading.cancel()
    return timed


async def probe(client: httpx.AsyncClient, url: str, body: dict) -> Timed:  # type: ignore[type-arg]
    return await infer(client, url, body)


@pytest.mark.parametrize(("streams", "body", "reason"), [
    # 2 streams x ~495 KV tokens on each 1,024-token worker: KV runs out while seats are left.
    (4, {"prompt": "Count to a thousand.", "max_tokens": 480, "ignore_eos": True}, "kv_full"),
    # 8 short streams take all 2 x 4 sequence slots while KV has room.
    (8, {"prompt": "Hi", "max_tokens": 120, "ignore_eos": True}, "sessions_full"),
])
async def test_503_names_the_full_limit_and_admits_again_after(cluster: Cluster, streams: int, body: dict,  # type: ignore[type-arg]
                                                              reason: str) -> None:
    small = {"prompt": "Hi", "max_tokens": 8}
    release, opened = asyncio.Event(), asyncio.Queue()  # type: ignore[var-annotated]
    async with httpx.AsyncClient(timeout=60) as client:
        holders = [asyncio.create_task(hold(client, cluster.url, body, opened, release)) for _ in range(streams)]
        try:
            for _ in range(streams):
                await asyncio.wait_for(opened.get(), timeout=60)
            refused = await probe(client, cluster.url, small)
            assert refused.status == 503 and refused.body is not None
            assert refused.body["reason"] == reason and refused.headers["retry-after"] == "1"
        finally:
            release.set()
            held = await asyncio.gather(*holders, return_exceptions=True)
        assert all(isinstance(t, Timed) for t in held), held
        # Every hung-up stream gave its reservation back; the workers freed their KV.
        wait_until(lambda: cluster.coordinator_health()["kv_reserved_bytes"] == 0, 5, "no reservation left")
        assert cluster.coordinator_health()["requests_running"] == 0
        admitted = await probe(client, cluster.url, small)
        assert admitted.status == 200 and admitted.names[-1] == "done"
    for worker_id in cluster.workers:
        wait_until(lambda w=worker_id: cluster.worker_load(w)["kv_reserved_bytes"] == 0, 5, f"{worker_id} KV freed")
