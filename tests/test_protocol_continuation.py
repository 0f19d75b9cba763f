"""The coordinator <-> worker contract's continuation of a stream on another worker: `token_ids` and
`TokenEvent.ids` (which tokens each event covers), `generated` (the tokens already streamed) and their
refusals; a token event without ids is what it was on the wire before."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from protocol.worker import MAX_GENERATED, GenerateRequest, TokenEvent
from worker.api.event_stream import token_event


@pytest.mark.parametrize(("body", "error"), [
    ({"generated": [1, 2], "max_tokens": 3}, None),
    ({"generated": [], "max_tokens": 1}, None),
    ({"generated": [1, 2], "max_tokens": 2}, "max_tokens: 2 leaves nothing to generate after the 2 tokens already"),
    ({"generated": [1], "max_tokens": 8, "n": 2}, "generated: a continuation continues one answer"),
    ({"generated": [1], "max_tokens": 8, "prompt_logprobs": 0}, "generated: a continuation does not score"),
    ({"generated": [-1], "max_tokens": 8}, "greater than or equal to 0"),
    ({"generated": ["1"], "max_tokens": 8}, "valid integer"),  # strict, as every number of this contract
    ({"generated": [0] * (MAX_GENERATED + 1), "max_tokens": 8}, "at most"),
    ({"token_ids": "yes"}, "valid boolean"),
])
def test_a_continuation_is_checked_before_any_worker_reads_it(body: dict[str, object], error: str | None) -> None:
    raw = json.dumps({"prompt": "hi", **body})
    if error is None:
        request = GenerateRequest.model_validate_json(raw)
        assert request.generated == body["generated"] and not request.token_ids
    else:
        with pytest.raises(ValidationError, match=error):
            GenerateRequest.model_validate_json(raw)


def test_internal_fields_default_to_a_plain_request() -> None:
    request = GenerateRequest(prompt="hi")
    assert request.token_ids is False and request.generated is None


@pytest.mark.parametrize("ids", [None, [], [5], [1, 2, 3]])
def test_a_token_events_ids_cross_the_wire_only_when_given(ids: list[int] | None) -> None:
    event = TokenEvent(token="x", index=3, probability=0.5, ids=ids)
    dumped = json.loads(event.model_dump_json())
    assert ("ids" in dumped) == (ids is not None)
    written = json.loads(token_event("x", 3, 0.5, 2, (), ids).decode().split("data: ", 1)[1])
    assert TokenEvent.model_validate(written) == TokenEvent(token="x", index=3, probability=0.5, choice=2, ids=ids)
    assert ("ids" in written) == (ids is not None)


def test_a_token_event_without_ids_is_byte_for_byte_as_before() -> None:
    assert token_event("Hi", 0, 0.5) == b'event: token\r\ndata: {"token":"Hi","index":0,"probability":0.5,' \
                                        b'"finished":false}\r\n\r\n'
