"""The embedding wire types: what parses, what is refused, and that heartbeats from before embeddings
still parse."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from protocol.health import Heartbeat
from protocol.openai_embeddings import EmbeddingList, EmbeddingRequest
from protocol.worker import MAX_EMBED_INPUTS, EmbedRequest, EmbedResponse

OLD_HEARTBEAT = {  # what a worker sent before embeddings existed
    "worker_id": "w1", "url": "http://127.0.0.1:3001", "model": "smol", "aliases": [], "model_identity": "",
    "protocol": 3, "timestamp": 1.0,
    "load": {"sessions": 0, "max_sessions": 4, "active_streams": 0, "queue_depth": 0, "kv_used_bytes": 0,
             "kv_reserved_bytes": 0, "kv_capacity_bytes": 1_000_000, "bytes_per_token": 100,
             "session_max_tokens": 2_000}}
SERVICE = {"dimensions": 576, "max_tokens": 512, "pooling": "mean", "capacity": 16}


def test_a_heartbeat_from_before_embeddings_parses_as_serving_none() -> None:
    assert Heartbeat.model_validate_json(json.dumps(OLD_HEARTBEAT)).embeddings is None


def test_a_heartbeat_says_what_embeddings_it_serves() -> None:
    beat = Heartbeat.model_validate({**OLD_HEARTBEAT, "embeddings": SERVICE})
    assert beat.embeddings is not None and beat.embeddings.model_dump() == SERVICE


@pytest.mark.parametrize("change", [{"dimensions": 0}, {"capacity": 0}, {"pooling": "rank"}, {"max_tokens": "512"},
                                    {"capacity": MAX_EMBED_INPUTS + 1}, {"extra": 1}])
def test_an_embedding_service_out_of_bounds_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Heartbeat.model_validate({**OLD_HEARTBEAT, "embeddings": {**SERVICE, **change}})


@pytest.mark.parametrize("body", [
    {"inputs": []}, {"inputs": [""]}, {"inputs": "one string"}, {"inputs": [1]}, {"inputs": ["a"], "dimensions": 0},
    {"inputs": ["a"], "dimensions": "4"}, {"inputs": ["a"], "tenant": "has space"}, {"inputs": ["a"], "other": 1},
    {"inputs": ["a"] * (MAX_EMBED_INPUTS + 1)},
])
def test_the_worker_request_is_strict(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        EmbedRequest.model_validate_json(json.dumps(body))


def test_the_worker_request_counts_its_bytes_and_sends_only_what_was_set() -> None:
    request = EmbedRequest.model_validate({"inputs": ["é", "ab"]})
    assert request.input_bytes() == 4
    assert json.loads(request.model_dump_json(exclude_unset=True)) == {"inputs": ["é", "ab"]}


@pytest.mark.parametrize(("raw", "kind"), [
    ('"text"', str), ('["a", "b"]', list), ("[1, 2]", list), ("[[1], [2, 3]]", list),
])
def test_openais_request_takes_every_input_form_openai_documents(raw: str, kind: type) -> None:
    assert isinstance(EmbeddingRequest.model_validate_json(f'{{"input": {raw}}}').input, kind)


@pytest.mark.parametrize("body", ['{"input": "a", "encoding_format": "int8"}', '{"input": "a", "dimensions": 0}',
                                  '{"input": ["a", 1]}', '{"input": 5}', '{"model": "m"}'])
def test_openais_request_refuses_other_values(body: str) -> None:
    with pytest.raises(ValidationError):
        EmbeddingRequest.model_validate_json(body)


def test_openais_request_ignores_unknown_fields_and_defaults_to_float() -> None:
    body = EmbeddingRequest.model_validate_json('{"input": "a", "something_new": true}')
    assert body.encoding_format == "float" and body.dimensions is None


def test_the_answers_parse_as_their_clients_read_them() -> None:
    EmbedResponse.model_validate({"model": "m", "dimensions": 2, "embeddings": ["AAAAAAAAAAA="],
                                  "prompt_tokens": [3], "request_id": "r", "worker_id": "w"})
    listing = EmbeddingList.model_validate({"data": [{"index": 0, "embedding": [0.6, 0.8]},
                                                     {"index": 1, "embedding": "AAAAAAAAAAA="}],
                                            "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3}})
    assert listing.object == "list" and listing.data[0].object == "embedding"
