"""The coordinator <-> worker contract's choices (`n`): its bounds, its refusal with a session, and a
one-choice stream that stays what it was on the wire before `n` existed."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from protocol.health import WorkerLoad
from protocol.worker import (
    MAX_CHOICES,
    ChoiceEnd,
    DoneEvent,
    GenerateRequest,
    Timings,
    TokenEvent,
    Usage,
)


@pytest.mark.parametrize(("body", "ok"), [
    ({"n": 1}, True),
    ({"n": 4}, True),
    ({"n": MAX_CHOICES}, True),
    ({"n": 0}, False),
    ({"n": MAX_CHOICES + 1}, False),
    ({"n": "2"}, False),  # strict, as every other number of this contract
    ({"n": 2, "session_id": "chat"}, False),  # which choice would the next turn continue?
    ({"n": 1, "session_id": "chat"}, True),
])
def test_n_is_bounded_and_one_shot(body: dict[str, object], ok: bool) -> None:
    raw = json.dumps({"prompt": "hi", **body})
    if ok:
        assert GenerateRequest.model_validate_json(raw).n == body["n"]
    else:
        with pytest.raises(ValidationError, match="n"):
            GenerateRequest.model_validate_json(raw)


def test_one_choice_is_sent_as_before() -> None:
    """The coordinator posts only the fields a client set, and a one-choice stream's events carry no
    choice fields: /coordinator/infer relays them as they are."""
    assert "n" not in json.loads(GenerateRequest(prompt="hi").model_dump_json(exclude_unset=True))
    assert set(json.loads(TokenEvent(token="a", index=0, probability=None).model_dump_json())) == {
        "token", "index", "probability", "finished"}
    done = DoneEvent(finish_reason="stop", usage=Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=2,
                                                       total_tokens=5),
                     timings=Timings(queue_ms=0, prefill_ms=0, ttft_ms=0, total_ms=0, tokens_per_second=0),
                     request_id="r", worker_id="w", model="m")
    assert "choices" not in json.loads(done.model_dump_json())
    several = done.model_copy(update={"choices": [ChoiceEnd(finish_reason="stop", completion_tokens=1),
                                                  ChoiceEnd(finish_reason="length", completion_tokens=1)]})
    assert json.loads(several.model_dump_json())["choices"][1] == {"finish_reason": "length", "completion_tokens": 1}
    assert DoneEvent.model_validate_json(several.model_dump_json()) == several
    assert json.loads(TokenEvent(token="a", index=0, probability=None, choice=3).model_dump_json())["choice"] == 3


def test_tools_are_checked_where_the_worker_would_misread_them() -> None:
    from protocol.worker import ChatMessage, GenerateRequest, ToolUse

    f = {"name": "f"}
    asked = [{"role": "user", "content": "hi"}]
    ok = GenerateRequest.model_validate({"messages": asked, "tools": {"functions": [f], "choice": "f"}})
    assert ok.tools is not None and ok.tools.forced and ok.prompt_bytes() > len("hi")
    for wrong in ({"functions": [f], "choice": "g"}, {"functions": [f, f]}, {"functions": []},
                  {"functions": [{"name": "bad name"}]}):
        with pytest.raises(ValidationError):
            ToolUse.model_validate(wrong)
    with pytest.raises(ValidationError, match="apply to a chat"):
        GenerateRequest.model_validate({"prompt": "hi", "tools": {"functions": [f]}})
    with pytest.raises(ValidationError, match="required call"):
        GenerateRequest.model_validate({"messages": asked, "tools": {"functions": [f], "choice": "required"},
                                        "json_schema": {"type": "object"}})
    # `auto` lets a request's own format hold the answer instead.
    GenerateRequest.model_validate({"messages": asked, "tools": {"functions": [f]}, "json_schema": {"type": "object"}})
    with pytest.raises(ValidationError, match="only an assistant"):
        ChatMessage.model_validate({"role": "user", "content": "", "tool_calls": [{"name": "f", "arguments": "{}"}]})


def test_a_heartbeat_lists_parked_streams_beyond_its_sessions_and_no_more() -> None:
    base = {"sessions": 2, "max_sessions": 2, "active_streams": 2, "queue_depth": 0, "kv_used_bytes": 0,
            "kv_reserved_bytes": 0, "kv_capacity_bytes": 1000, "bytes_per_token": 1, "session_max_tokens": 500}
    assert WorkerLoad(**base, streams=[1, 2, 3], parked=1, parkable=1).parked == 1
    with pytest.raises(ValidationError):
        WorkerLoad(**base, streams=[1, 2, 3])  # a third stream is neither running nor parked
    with pytest.raises(ValidationError):
        WorkerLoad(**base, parkable=3)  # it cannot park more than it runs


def test_a_prompt_of_token_ids_is_raw_and_the_only_prompt() -> None:
    request = GenerateRequest(prompt_tokens=[1, 2, 3], raw=True)
    assert request.prompt_bytes() == 3
    for bad in ({"prompt_tokens": [1, 2]}, {"prompt_tokens": [1], "prompt": "x", "raw": True},
                {"prompt_tokens": [-1], "raw": True}, {"prompt_tokens": [], "raw": True}):
        with pytest.raises(ValidationError):
            GenerateRequest(**bad)  # type: ignore[arg-type]
