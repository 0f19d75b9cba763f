"""bench.hostile_mix's kinds: each is a request the pool's wire types accept, and a simple bound of
each (n, biases, stops, embedding inputs) is at its limit, so the mix measures the largest of its kind."""

from __future__ import annotations

import pytest

from bench.hostile_mix import KINDS
from protocol.openai import ChatCompletionRequest, CompletionRequest
from protocol.openai_embeddings import EmbeddingRequest
from protocol.worker import MAX_STOP_LENGTH, MAX_STOP_STRINGS


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_is_a_request_the_wire_types_accept(kind: str) -> None:
    hostile = KINDS[kind]()
    assert hostile
    for request in hostile:
        if request.path == "/v1/embeddings":
            EmbeddingRequest.model_validate(request.body)
        elif request.path == "/v1/completions":
            CompletionRequest.model_validate(request.body)
        else:
            assert request.path == "/v1/chat/completions"
            ChatCompletionRequest.model_validate(request.body)


def test_the_simple_bounds_are_at_their_limits() -> None:
    (bias,) = KINDS["logit_bias"]()
    assert len(bias.body["logit_bias"]) == 300
    (stops,) = KINDS["stops"]()
    assert len(stops.body["stop"]) == MAX_STOP_STRINGS and {len(s) for s in stops.body["stop"]} == {MAX_STOP_LENGTH}
    (choices,) = KINDS["choices"]()
    assert choices.body["n"] == 8  # MAX_CHOICES' default
    (embed,) = KINDS["embeddings"]()
    assert len(embed.body["input"]) == 256
