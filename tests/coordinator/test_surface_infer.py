"""The `/coordinator/infer` surface passes internal events through as they are: this pins that the
internal events of protocol version 1 still have exactly the public contract's shapes, so a change to
protocol/worker.py that would change this surface's output fails here first."""

from __future__ import annotations

import json

import pytest

from coordinator.errors import CoordinatorError
from coordinator.relay.response import passthrough
from coordinator.surfaces.infer import parse
from protocol import inference, worker
from protocol.sse import SseEvent

PUBLIC_DONE = {"finished", "finish_reason", "usage", "timings", "request_id", "worker_id", "model", "session_id",
               "cached"}


def test_public_event_shapes_are_the_internal_ones() -> None:
    """Protocol 4 added `choice` to token events and `choices` to `done` (several choices per request).
    This surface serves one choice only (`n` is not one of its fields), and a one-choice event leaves
    both out of its JSON: what it writes is what it wrote."""
    assert inference.TokenEvent.model_json_schema() == {
        **worker.TokenEvent.model_json_schema()}
    assert set(inference.DoneEvent.model_fields) == PUBLIC_DONE | {"choices"}
    token = worker.TokenEvent(token="a", index=0, probability=0.5)
    assert set(json.loads(token.model_dump_json())) == {"token", "index", "probability", "finished"}
    done = worker.DoneEvent(finish_reason="stop", request_id="r", worker_id="w", model="m",
                            usage=worker.Usage(prompt_tokens=1, cached_tokens=0, completion_tokens=1, total_tokens=2),
                            timings=worker.Timings(queue_ms=0, prefill_ms=0, ttft_ms=0, total_ms=0,
                                                   tokens_per_second=0))
    assert set(json.loads(done.model_dump_json())) == PUBLIC_DONE
    assert set(inference.ErrorEvent.model_fields) == {"error", "reason", "request_id", "finished"}
    assert set(inference.Usage.model_fields) == {"prompt_tokens", "cached_tokens", "completion_tokens",
                                                 "total_tokens"}
    assert (inference.EVENT_TOKEN, inference.EVENT_DONE, inference.EVENT_ERROR) == ("token", "done", "error")


def test_events_are_written_as_the_worker_sent_them() -> None:
    data = '{"token":"Hi","index":0,"probability":0.5,"finished":false}'
    assert passthrough(SseEvent("token", data)) == f"event: token\r\ndata: {data}\r\n\r\n".encode()


def test_parse_sends_only_the_fields_the_client_set() -> None:
    gen = parse(b'{"prompt": "hi", "max_tokens": 5, "stop": "x"}', "r1")
    assert gen.payload == b'{"max_tokens":5,"stop":["x"],"prompt":"hi"}'
    assert (gen.request.messages, gen.request_id, gen.demand.prompt_bytes, gen.surface) == (None, "r1", 2, "infer")


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "x"}]}', b'{"prompt": "x", "n": 1}',
                                 b"[1]", b"{",
                                 # Loose types (before: true was taken as 1, strings as numbers).
                                 b'{"prompt": "x", "max_tokens": true}', b'{"prompt": "x", "max_tokens": "5"}',
                                 b'{"prompt": "x", "temperature": "0.5"}', b'{"prompt": "x", "ignore_eos": 1}',
                                 b'{"prompt": "x", "seed": 1.5}'])
def test_parse_refuses_what_the_public_contract_does_not_have(raw: bytes) -> None:
    with pytest.raises(CoordinatorError) as caught:
        parse(raw, "r1")
    assert caught.value.status == 400
