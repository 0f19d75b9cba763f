"""The llama.cpp embedding context on the real SmolLM2 model: its pooling, sizes and vectors."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp as ll
import numpy as np
import pytest

from worker.backends.llama_embedder import LlamaEmbeddingContext
from worker.backends.llama_model import Model

pytestmark = pytest.mark.model
TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "A kitten rested on the rug."]


@pytest.fixture(scope="module")
def context(model: Model) -> Iterator[LlamaEmbeddingContext]:
    found = LlamaEmbeddingContext(model, ctx_tokens=512, max_inputs=4, threads=1)
    yield found
    found.close()


def vectors(context: LlamaEmbeddingContext, model: Model, texts: list[str]) -> np.ndarray:
    raw = context.embed([model.tokenize(t, add_special=True) for t in texts])
    return np.stack([np.frombuffer(v, dtype="<f4") for v in raw])


def test_a_generation_model_gets_mean_pooling_at_its_hidden_size(context: LlamaEmbeddingContext, model: Model) -> None:
    assert model.meta_str("llama.pooling_type") is None  # SmolLM2 says nothing: llama.cpp reports none
    assert context.pooling == "mean"
    assert context.dimensions == model.shape.n_embd == 576
    assert (context.max_tokens, context.max_inputs) == (512, 4)


def test_vectors_are_unit_length_and_do_not_depend_on_their_batch(context: LlamaEmbeddingContext,
                                                                   model: Model) -> None:
    together = vectors(context, model, TEXTS)
    assert together.shape == (3, 576)
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    for i, text in enumerate(TEXTS):
        assert np.allclose(vectors(context, model, [text])[0], together[i], atol=1e-5)
    again = vectors(context, model, [TEXTS[2], TEXTS[0], TEXTS[0]])
    # Identical inputs at two places of one batch: the same up to float32 rounding of the sums' order.
    assert np.allclose(again[1], again[2], atol=1e-6)
    assert np.array_equal(vectors(context, model, TEXTS), together)  # the same batch again: bit for bit
    assert np.allclose(again[0], together[2], atol=1e-5) and np.allclose(again[1], together[0], atol=1e-5)
    assert not np.allclose(together[0], together[1], atol=1e-2)


def test_the_vector_is_the_normalised_mean_of_the_token_states(context: LlamaEmbeddingContext, model: Model) -> None:
    """Against llama.cpp's per-token states from a context with no pooling at all."""
    tokens = model.tokenize(TEXTS[1], add_special=True)
    params = ll.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 64
    params.embeddings, params.pooling_type, params.n_threads, params.n_threads_batch = True, 0, 1, 1
    ctx = ll.llama_init_from_model(model.handle, params)
    batch = ll.llama_batch_init(64, 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert ll.llama_decode(ctx, batch) == 0
        states = np.stack([np.ctypeslib.as_array(ll.llama_get_embeddings_ith(ctx, i), shape=(576,)).copy()
                           for i in range(len(tokens))])
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
    mean = states.mean(axis=0)
    assert np.allclose(vectors(context, model, [TEXTS[1]])[0], mean / np.linalg.norm(mean), atol=1e-4)
    last = states[-1] / np.linalg.norm(states[-1])
    assert not np.allclose(vectors(context, model, [TEXTS[1]])[0], last, atol=1e-2)  # not last-token pooling


def test_a_full_batch_decodes_and_a_larger_one_is_refused(context: LlamaEmbeddingContext, model: Model) -> None:
    long = model.tokenize("word " * 600, add_special=True)[:512]
    assert len(context.embed([long])) == 1  # one input may take the whole context
    with pytest.raises(ValueError):
        context.embed([long, [long[0]]])
    with pytest.raises(ValueError):
        context.embed([[1]] * 5)
