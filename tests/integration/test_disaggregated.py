"""Disaggregated prefill over real workers (DISAGGREGATE_PROMPT_BYTES): a long prompt is prefilled on
one worker, its cells fetched by the other, which decodes; the answer is the one the prefilling worker
gives itself, and the decoding worker prefilled almost nothing."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Proc, start_coordinator, start_worker, stop_all
from tests.polling import wait_until

pytestmark = pytest.mark.model
PROMPT = ("The archive keeps maps of every valley, each drawn by a different hand, and the keeper knows "
          "which of them can be trusted. ") * 14 + "Which map should a traveller take?"


def events(response: httpx.Response) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    out, name = [], ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
    return out


def test_a_long_prompt_prefilled_on_one_worker_is_decoded_on_the_other_with_the_same_answer(
        model_path: Path, tmp_path: Path) -> None:
    procs: list[Proc] = []
    try:
        coordinator, url = start_coordinator(tmp_path, "c", "--heartbeat-interval", "0.5",
                                             "--disaggregate-prompt-bytes", "1000")
        procs.append(coordinator)
        worker_urls = {}
        for worker_id in ("w1", "w2"):
            worker, worker_urls[worker_id] = start_worker(tmp_path, worker_id, url, model_path, "--threads", "1",
                                                          "--max-sessions", "4", "--heartbeat-interval", "0.25")
            procs.append(worker)
        wait_until(lambda: httpx.get(url + "/coordinator/health", timeout=2).json()["workers"]["alive"] == 2, 60,
                   "both workers alive")
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", url + "/coordinator/infer", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            decoder = response.headers["x-worker-id"]
            streamed = events(response)
        done = streamed[-1][1]
        assert streamed[-1][0] == "done", streamed[-1]
        text = "".join(data["token"] for name, data in streamed if name == "token")
        prompt_tokens, cached = done["usage"]["prompt_tokens"], done["usage"]["cached_tokens"]
        assert prompt_tokens > 300 and cached >= prompt_tokens - 8, done["usage"]  # fetched, not prefilled
        prefiller = next(w for w in worker_urls if w != decoder)
        # The prefilling worker answers the same prompt itself, from its own cells: the same tokens.
        with httpx.stream("POST", worker_urls[prefiller] + "/worker/generate", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            own = events(response)
        assert "".join(data["token"] for name, data in own if name == "token") == text
        assert own[-1][1]["usage"]["cached_tokens"] >= prompt_tokens - 8  # its leftover from the prefill
    finally:
        stop_all(reversed(procs))
