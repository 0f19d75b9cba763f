"""/metrics on a real worker moves the way the requests it served say it should."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.sse import generate
from tests.worker.server import running_worker

pytestmark = pytest.mark.model


def test_metrics_follow_real_requests(model_path: Path) -> None:
    with running_worker(model_path, max_sessions=1) as worker:
        m = worker.metric
        done = generate(worker.url, {"prompt": "Say hello.", "max_tokens": 9, "ignore_eos": True}).last[1]
        assert m("worker_generation_tokens_total") == 9
        assert m("worker_prompt_tokens_total") == done["usage"]["prompt_tokens"]
        assert m('worker_requests_finished_total{finish_reason="length"}') == 1
        assert m('worker_admission_decisions_total{outcome="admitted",reason=""}') == 1
        assert m("worker_time_to_first_token_seconds_count") == 1
        assert m("worker_inter_token_latency_seconds_count") == 8  # gaps between 9 tokens
        assert m("worker_batch_size_count") >= 9  # one prefill step, then one step per token
        assert m("worker_num_requests_running") == 0 and m("worker_kv_cache_usage_ratio") == 0
        # a kept session shows in the KV gauges; a refusal is counted with its reason
        generate(worker.url, {"prompt": "Remember me.", "max_tokens": 4, "session_id": "m1"})
        assert m("worker_sessions") == 1 and m("worker_kv_cache_usage_ratio") > 0
        assert generate(worker.url, {"prompt": "x", "model": "other"}).status == 404
        assert m('worker_admission_decisions_total{outcome="rejected",reason="unknown_model"}') == 1
        # refusals outside /worker/generate are not admission decisions
        assert httpx.delete(worker.url + "/worker/sessions/nobody").status_code == 404
        with pytest.raises(KeyError):
            m('worker_admission_decisions_total{outcome="rejected",reason="unknown_session"}')


def test_the_gauges_add_up_every_model_served() -> None:
    """WORKER_MAX_MODELS: one worker's gauges over the runtimes of its slots (worker/runtime.py bind_gauges),
    the KV ratio over all their cells; with none served, zeros."""
    from types import SimpleNamespace

    from worker.metrics import WorkerMetrics
    from worker.runtime import bind_gauges

    def runtime(running: int, sessions: int, used: int, capacity: int) -> SimpleNamespace:
        table = SimpleNamespace(stats=lambda: (sessions, used, used), limits=SimpleNamespace(capacity_tokens=capacity),
                                expired_total=1, evicted_total=0, parked=0)
        return SimpleNamespace(engine=SimpleNamespace(running=running, queue_depth=0), table=table, embedder=None)

    served = [runtime(2, 3, 100, 1000), runtime(1, 1, 300, 1000)]
    metrics = WorkerMetrics()
    bind_gauges(metrics, lambda: served)  # type: ignore[arg-type, return-value]

    def value(name: str) -> float:
        line = next(line for line in metrics.render().decode().splitlines() if line.startswith(name + " "))
        return float(line.split()[1])

    assert (value("worker_num_requests_running"), value("worker_sessions")) == (3, 4)
    assert value("worker_kv_cache_usage_ratio") == 0.2 and value("worker_sessions_expired_total") == 2
    served.clear()
    assert (value("worker_num_requests_running"), value("worker_kv_cache_usage_ratio")) == (0, 0)


def test_a_steps_gaps_at_once_read_as_each_observed() -> None:
    """`token_gaps` (one call per engine step) leaves the inter-token histogram as `observe` per gap would,
    bounds included (a gap equal to a bucket's bound falls in that bucket)."""
    from worker.metrics import WorkerMetrics

    gaps = [0.001, 0.0025, 0.0025, 0.04, 0.3, 7.0, 1e9, 0.0]
    one, many = WorkerMetrics(), WorkerMetrics()
    for gap in gaps:
        one.token_gap(gap)
    many.token_gaps(gaps)
    many.token_gaps([])

    def itl(metrics: WorkerMetrics) -> list[str]:
        return [line for line in metrics.render().decode().splitlines()
                if line.startswith("worker_inter_token_latency_seconds") and "_created" not in line]

    assert itl(many) == itl(one)
    assert any(line.endswith(" 8.0") for line in itl(one) if "_count" in line)
