"""`/v1/embeddings` end to end: the official `openai` client against the real coordinator and two real
workers embedding with the real model (mean-pooled SmolLM2 states: docs/benchmarks.md, "Embeddings")."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.model, pytest.mark.anyio]
MODEL = "smollm2-135m-8k-lc100k-mix1-ep2"
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "Quarterly profits rose by ten percent."]


def as_array(data: list[openai.types.Embedding]) -> np.ndarray:
    return np.array([d.embedding for d in data], dtype=np.float64)


async def test_a_string_gives_one_unit_vector_of_the_models_size(sdk: openai.AsyncOpenAI) -> None:
    answer = await sdk.embeddings.create(model=MODEL, input=TEXTS[0])  # the SDK asks for base64 and decodes it
    assert answer.model == MODEL and [d.index for d in answer.data] == [0]
    vector = np.array(answer.data[0].embedding)
    assert vector.shape == (576,) and abs(np.linalg.norm(vector) - 1.0) < 1e-5


async def test_a_list_keeps_its_order_and_every_encoding_gives_the_same_vectors(sdk: openai.AsyncOpenAI) -> None:
    decoded = await sdk.embeddings.create(model=MODEL, input=TEXTS)
    floats = await sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    raw = await sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    assert [d.index for d in floats.data] == [0, 1, 2]
    as_floats = as_array(floats.data)
    assert np.allclose(as_array(decoded.data), as_floats, atol=1e-6)
    own = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")  # type: ignore[arg-type]
                    for d in raw.data])
    assert np.allclose(own, as_floats, atol=1e-6)
    assert np.allclose(np.linalg.norm(as_floats, axis=1), 1.0, atol=1e-5)
    # Order: each item is its own input's vector, as when that input is embedded alone.
    for i, text in enumerate(TEXTS):
        alone = await sdk.embeddings.create(model=MODEL, input=text, encoding_format="float")
        assert np.allclose(alone.data[0].embedding, as_floats[i], atol=1e-5)
    assert not np.allclose(as_floats[0], as_floats[1], atol=1e-3)


async def test_identical_inputs_give_identical_vectors(sdk: openai.AsyncOpenAI) -> None:
    together = await sdk.embeddings.create(model=MODEL, input=[TEXTS[1], TEXTS[0], TEXTS[1]],
                                           encoding_format="float")
    again = await sdk.embeddings.create(model=MODEL, input=[TEXTS[1], TEXTS[0], TEXTS[1]], encoding_format="float")
    vectors = as_array(together.data)
    assert np.allclose(vectors[0], vectors[2], atol=1e-6)
    assert np.allclose(as_array(again.data), vectors, atol=1e-6)  # whichever worker served it


async def test_usage_is_the_inputs_real_token_counts(sdk: openai.AsyncOpenAI) -> None:
    """Against the same model's count of each text as a raw prompt (the worker's tokenizer, by the
    completions route)."""
    answer = await sdk.embeddings.create(model=MODEL, input=TEXTS)
    counted = 0
    for text in TEXTS:
        completion = await sdk.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
        assert completion.usage is not None
        counted += completion.usage.prompt_tokens
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == counted > len(TEXTS)


async def test_an_input_longer_than_the_embedding_context_is_a_bad_request(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.embeddings.create(model=MODEL, input=["short", "word " * 600])
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "input"
    assert "512 tokens" in refused.value.message


async def test_token_ids_and_another_size_are_refused_by_name(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as ids:
        await sdk.embeddings.create(model=MODEL, input=[[1, 2, 3]])
    with pytest.raises(openai.BadRequestError) as size:
        await sdk.embeddings.create(model=MODEL, input="a", dimensions=64)
    assert (ids.value.param, size.value.param) == ("input", "dimensions")


def test_both_workers_say_they_embed_and_count_what_they_did(cluster: Cluster) -> None:
    before = _counted(cluster)
    response = httpx.post(cluster.url + "/v1/embeddings", json={"model": MODEL, "input": TEXTS}, timeout=60)
    assert response.status_code == 200, response.text
    for worker_id, url in cluster.worker_urls.items():
        health = httpx.get(url + "/worker/health", timeout=5).json()
        assert health["embeddings"] == {"dimensions": 576, "max_tokens": 512, "pooling": "mean", "capacity": 16}, \
            worker_id
    after = _counted(cluster)
    assert after["inputs"] - before["inputs"] == 3
    assert after["tokens"] - before["tokens"] == response.json()["usage"]["prompt_tokens"]


def _counted(cluster: Cluster) -> dict[str, float]:
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("coordinator_embedding_")}
    return {"inputs": values.get("coordinator_embedding_inputs_total", 0.0),
            "tokens": values.get("coordinator_embedding_tokens_total", 0.0)}
