"""`POST /worker/generate`'s continuation fields over HTTP, on the simulated backend (which coordinator-scale
tests and benchmarks run on): `token_ids` puts each token event's ids on the wire, and a request with
`generated` streams the rest of the answer, numbered on, counted as one answer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sse import generate
from tests.worker.server import RunningWorker, running_worker


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    with running_worker(tmp_path_factory.mktemp("sim") / "none.gguf", engine="simulated", sim_token_rate=1000.0,
                        max_sessions=4) as running:
        yield running


ASK = {"prompt": "tell me about foxes", "max_tokens": 14}


def test_token_ids_put_each_events_ids_on_the_wire_and_only_then(worker: RunningWorker) -> None:
    plain = generate(worker.url, ASK)
    assert all("ids" not in event for event in plain.tokens)
    tagged = generate(worker.url, {**ASK, "token_ids": True})
    assert tagged.text == plain.text
    assert [event["ids"] for event in tagged.tokens] == [[i % 12] for i in range(14)]  # the simulator's words


@pytest.mark.parametrize("cut", [1, 5, 13])
def test_a_request_with_generated_streams_the_rest_as_one_answer(worker: RunningWorker, cut: int) -> None:
    whole = generate(worker.url, {**ASK, "token_ids": True})
    generated = [t for event in whole.tokens[:cut] for t in event["ids"]]
    rest = generate(worker.url, {**ASK, "token_ids": True, "generated": generated})
    assert rest.events[0] == whole.events[0]  # admitted: the prompt alone
    assert [e["index"] for e in rest.tokens] == list(range(cut, 14))
    assert [e["ids"] for e in rest.tokens] == [e["ids"] for e in whole.tokens[cut:]]
    assert "".join(e["token"] for e in whole.tokens[:cut]) + rest.text == whole.text
    done, again = whole.last[1], rest.last[1]
    assert again["finish_reason"] == "length" == done["finish_reason"]
    assert again["usage"]["completion_tokens"] == 14 and again["usage"]["prompt_tokens"] == done["usage"]["prompt_tokens"]


def test_a_continuation_with_nothing_left_to_generate_is_refused_with_400(worker: RunningWorker) -> None:
    refused = generate(worker.url, {**ASK, "generated": list(range(14))})
    assert refused.status == 400 and "already generated" in str(refused.body)
