"""bench.load.runner over httpx.MockTransport: bounds of a point, the run-wide cap, the failure pause."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.load.clients import InferClient, Sampling
from bench.load.runner import Point, Runner
from bench.load.workload import Workload

OK = (b'event: token\ndata: {"token": "a", "index": 0, "probability": 1}\n\n'
      b'event: done\ndata: {"usage": {"completion_tokens": 1}}\n\n')


def runner(status: int = 200, **kwargs: object) -> Runner:
    def handler(request: httpx.Request) -> httpx.Response:
        if status != 200:
            return httpx.Response(status, json={"error": "full", "reason": "sessions_full", "request_id": "r"})
        return httpx.Response(200, content=OK)

    return Runner(InferClient("http://127.0.0.1:1", Sampling()), Workload(), progress=False,
                  transport=httpx.MockTransport(handler), **kwargs)  # type: ignore[arg-type]


def test_a_point_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="stop by itself"):
        Point("closed", 4)


def test_requests_per_point_and_the_cap_over_the_run() -> None:
    r = runner(cap=25)
    results = asyncio.run(r.sweep([Point("closed", 2, 10), Point("closed", 4, 10), Point("open", 1000.0, 10),
                                   Point("closed", 1, 10)]))
    assert [x.summary.requests for x in results] == [10, 10, 5]  # the cap cuts the third; the fourth never runs
    assert r.remaining == 0
    assert [rec.index for rec in results[0].records] == list(range(10))


def test_a_duration_point_stops_by_itself() -> None:
    result = asyncio.run(runner().run(Point("closed", 2, duration=0.2)))
    assert result.summary.requests > 0
    assert 0.2 <= result.summary.duration_s < 2.0


@pytest.mark.parametrize("pause,most", [(0.05, 8), (0.0, None)])
def test_a_refused_closed_loop_user_pauses_before_its_next_request(pause: float, most: int | None) -> None:
    result = asyncio.run(runner(503, failure_pause=pause).run(Point("closed", 1, duration=0.3)))
    assert result.summary.errors == {"http 503 sessions_full": result.summary.requests}
    if most is not None:
        assert result.summary.requests <= most
    else:
        assert result.summary.requests > 20  # without the pause it retries at once
