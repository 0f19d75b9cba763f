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
