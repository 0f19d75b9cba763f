"""Asking a peer worker for a prefix's cells (worker/peers.py): a busy peer is asked again within the
bound, anything else is "no prefix"."""

from __future__ import annotations

import httpx
import pytest

from worker.metrics import WorkerMetrics
from worker.peers import HttpPeers

pytestmark = [pytest.mark.anyio, pytest.mark.unit]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def peers_answering(*statuses: int, timeout: float = 2.0) -> tuple[HttpPeers, list[int], WorkerMetrics]:
    asked: list[int] = []
    metrics = WorkerMetrics()

    def answer(request: httpx.Request) -> httpx.Response:
        status = statuses[min(len(asked), len(statuses) - 1)]
        asked.append(status)
        return httpx.Response(status, content=b"cells" if status == 200 else b'{"reason":"transfers_full"}')

    peers = HttpPeers(token=None, min_tokens=1, timeout=timeout, max_bytes=1 << 20, metrics=metrics)
    peers.open(httpx.MockTransport(answer))
    return peers, asked, metrics


def outcomes(metrics: WorkerMetrics, outcome: str) -> float:
    return metrics.kv_transfers.labels(direction="peer_prefix", outcome=outcome)._value.get()


async def test_a_busy_peer_is_asked_again_until_its_slot_frees() -> None:
    peers, asked, metrics = peers_answering(503, 503, 200)
    assert await peers.fetch("http://peer.test", [1, 2, 3], "", 1) == b"cells"
    assert asked == [503, 503, 200] and outcomes(metrics, "ok") == 1


async def test_a_peer_busy_past_the_bound_or_without_the_prefix_gives_none() -> None:
    busy, asked, metrics = peers_answering(503, timeout=0.3)
    assert await busy.fetch("http://peer.test", [1, 2, 3], "", 1) is None
    assert 2 <= len(asked) <= 10 and outcomes(metrics, "failed") == 1  # asked again, within the bound
    none, asked, metrics = peers_answering(404)
    assert await none.fetch("http://peer.test", [1, 2, 3], "", 1) is None
    assert asked == [404] and outcomes(metrics, "none") == 1  # not asked again
