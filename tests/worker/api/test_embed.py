"""The worker's embed route over real HTTP: the real SmolLM2 model, and the simulated engine where no
model is needed (a worker without embeddings)."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from protocol.worker import EmbedResponse
from tests.polling import wait_until
from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker

TEXTS = ["The cat sat on the mat.", "A kitten rested on the rug.", "Stock markets fell sharply."]


@pytest.fixture(scope="module")
def worker(model_path: Path) -> Iterator[RunningWorker]:
    with running_worker(model_path, threads=1, embedding_ctx=256) as running:
        yield running


def embed(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + "/worker/embed", json=body, headers=headers, timeout=60)


def vectors(answer: EmbedResponse) -> np.ndarray:
    return np.stack([np.frombuffer(base64.b64decode(v), dtype="<f4") for v in answer.embeddings])


@pytest.mark.model
def test_one_unit_vector_per_input_with_each_inputs_token_count(worker: RunningWorker) -> None:
    before = {name: worker.metric(name) for name in ("worker_embedding_inputs_total", "worker_embedding_tokens_total")}
    response = embed(worker.url, {"inputs": TEXTS}, **{"X-Request-ID": "emb-1"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "emb-1"
    assert response.headers["x-worker-id"] == worker.settings.worker_id
    answer = EmbedResponse.model_validate(response.json())
    found = vectors(answer)
    assert answer.dimensions == 576 and found.shape == (3, 576) and answer.model == worker.runtime.names.name
    assert np.allclose(np.linalg.norm(found, axis=1), 1.0, atol=1e-5)
    model = worker.runtime.model
    assert answer.prompt_tokens == [len(model.tokenize(t, add_special=True)) for t in TEXTS]
    assert worker.metric('worker_embedding_requests_total{outcome="ok"}') >= 1
    assert worker.metric("worker_embedding_inputs_total") == before["worker_embedding_inputs_total"] + 3
    assert worker.metric("worker_embedding_tokens_total") == before["worker_embedding_tokens_total"] + sum(
        answer.prompt_tokens)


@pytest.mark.model
def test_health_says_what_embeddings_it_serves(worker: RunningWorker) -> None:
    assert worker.health()["embeddings"] == {"dimensions": 576, "max_tokens": 256, "pooling": "mean",
                                             "capacity": 16}


@pytest.mark.model
@pytest.mark.parametrize("body, status, reason", [
    ({"inputs": ["ok", "word " * 300]}, 413, "prompt_too_long"),
    ({"inputs": ["ok"], "dimensions": 64}, 400, "invalid_request"),
    ({"inputs": ["ok"], "model": "another-model"}, 404, "unknown_model"),
    ({"inputs": []}, 400, "invalid_request"),
    ({"inputs": [""]}, 400, "invalid_request"),
])
def test_refusals_name_their_reason(worker: RunningWorker, body: dict[str, Any], status: int, reason: str) -> None:
    response = embed(worker.url, body)
    assert response.status_code == status, response.text
    assert response.json()["reason"] == reason and response.json()["request_id"]


@pytest.mark.model
def test_the_models_own_size_may_be_asked_for(worker: RunningWorker) -> None:
    assert embed(worker.url, {"inputs": ["ok"], "dimensions": 576}).status_code == 200


@pytest.mark.model
def test_generation_goes_on_while_the_embedder_computes(worker: RunningWorker) -> None:
    """The embedder's context is held mid-batch; a generation runs to its end meanwhile, so embeddings
    never enter the decode loop (nor block the event loop that serves the stream)."""
    embedder: Any = worker.runtime.embedder
    real, entered, release = embedder.context, threading.Event(), threading.Event()

    class Held:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def embed(self, inputs: list[list[int]]) -> list[bytes]:
            entered.set()
            assert release.wait(30)
            return real.embed(inputs)  # type: ignore[no-any-return]

    embedder.context = Held()
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(embed, worker.url, {"inputs": TEXTS})
            assert entered.wait(10)
            stream = generate(worker.url, {"prompt": "Name three colors.", "max_tokens": 12, "temperature": 0})
            assert stream.last[0] == "done" and not pending.done()
            release.set()
            assert pending.result(30).status_code == 200
    finally:
        release.set()
        embedder.context = real


def test_a_worker_without_embeddings_refuses_them_and_says_so(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", embeddings=False) as sim:
        assert sim.health()["embeddings"] is None
        response = embed(sim.url, {"inputs": ["hello"]})
        assert response.status_code == 400 and response.json()["reason"] == "embeddings_unsupported"


def test_the_simulated_engine_embeds_with_the_same_contract(tmp_path: Path) -> None:
    with running_worker(tmp_path / "none.gguf", engine="simulated", embedding_queue=2) as sim:
        response = embed(sim.url, {"inputs": ["hello there", "hello there", "other words"]})
        answer = EmbedResponse.model_validate(response.json())
        found = vectors(answer)
        assert answer.dimensions == 64 and np.allclose(np.linalg.norm(found, axis=1), 1.0, atol=1e-5)
        assert np.array_equal(found[0], found[1]) and not np.allclose(found[0], found[2])
        wait_until(lambda: sim.metric("worker_embedding_requests_held") == 0, 5, "the request to be let go")
