"""The tokenizer's path (coordinator/tokenizing.py): the model's workers that take requests, the fewest of this
coordinator's streams first, tried by the one loop of tries (each worker judged and each failover counted, as
for any request), and the refusals when none can or none answered; over fake workers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.errors import CoordinatorError
from coordinator.settings import Settings
from coordinator.state import CoordinatorState, build_state
from coordinator.tokenizing import ATTEMPTS
from protocol import reasons
from protocol.tokens import TokenizeResponse
from protocol.worker import TOKENIZE_PATH, TokenizeWork
from tests.coordinator.fakes import FakeWorkerClient, heartbeat

pytestmark = pytest.mark.anyio
WORK = TokenizeWork(prompt="two words", add_special=True)
ANSWER = {"count": 2, "max_model_len": 512, "tokens": [1, 2], "token_strs": None}


def answered(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=ANSWER)


def refusing(status: int, reason: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, json={"error": reason, "reason": reason, "request_id": "x"})


@asynccontextmanager
async def pool(answers: dict[str, Callable[[httpx.Request], httpx.Response]], **load: dict[str, Any]
               ) -> AsyncIterator[tuple[CoordinatorState, list[str]]]:
    """A coordinator's state over workers answering `answers` (by host), each heartbeating with its `load`."""
    tried: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host.removesuffix(".test")
        tried.append(host)
        return answers[host](request)

    clock = ManualClock()
    state = build_state(Settings(retry_after=7), clock,
                        FakeWorkerClient(httpx.AsyncClient(transport=httpx.MockTransport(handle))))
    for worker_id in answers:
        state.registry.upsert(heartbeat(worker_id, timestamp=clock.time(), **load.get(worker_id, {})),
                              clock.monotonic())
    try:
        yield state, tried
    finally:
        await state.client.close()


async def test_the_least_busy_worker_of_the_model_that_takes_requests_is_asked_and_a_failure_moves_on() -> None:
    answers = {"busy": answered, "idle": refusing(500, reasons.INTERNAL), "draining": answered,
               "tripped": answered, "other": answered, "spare": answered}
    async with pool(answers, draining={"draining": True}, other={"model": "gemma"}) as (state, tried):
        state.registry.get("busy").in_flight = 2  # type: ignore[union-attr]
        state.registry.get("spare").in_flight = 3  # type: ignore[union-attr]
        tripped = state.registry.get("tripped")
        assert tripped is not None
        tripped.breaker_trips, tripped.breaker_open_until = 1, state.clock.monotonic() + 30
        tokenized = await state.tokenizing.ask(TOKENIZE_PATH, "smol", WORK, TokenizeResponse, "r1")
        assert tried == ["idle", "busy"] and tokenized.worker_id == "busy" and tokenized.answer == ANSWER
        # The failure is the worker's, as on any request: its breaker counts it, and the failover is counted.
        assert state.registry.get("idle").breaker_failures == 1  # type: ignore[union-attr]
        assert state.metrics.failovers.labels(reason=reasons.INTERNAL)._value.get() == 1


async def test_when_no_worker_answers_the_answer_is_unavailable_with_the_last_reason_and_a_retry_after() -> None:
    """Refusals too (a worker still loading): 502, not the workers' 503, as before the one loop."""
    answers = {"w1": refusing(503, reasons.LOADING), "w2": lambda request: httpx.Response(200, json={"count": 1}),
               "w3": refusing(503, reasons.LOADING)}
    async with pool(answers) as (state, tried):
        with pytest.raises(CoordinatorError) as refused:
            await state.tokenizing.ask(TOKENIZE_PATH, None, WORK, TokenizeResponse, "r1")
    assert len(tried) == ATTEMPTS == 2 and tried == ["w1", "w2"]  # w2's answer is not a tokenizer's: moved on
    error = refused.value
    assert error.reason == reasons.WORKER_UNAVAILABLE and error.retry_after == 7 and "worker_failed" in str(error)


@pytest.mark.parametrize(("workers", "reason"), [(0, reasons.NO_WORKERS), (1, reasons.MODEL_UNAVAILABLE)])
async def test_with_no_worker_to_ask_the_refusal_says_why(workers: int, reason: str) -> None:
    """No worker at all, or none of the model that takes requests (here: it drains)."""
    answers = {"w1": refusing(500, reasons.INTERNAL)} if workers else {}
    async with pool(answers, w1={"draining": True}) as (state, tried):
        with pytest.raises(CoordinatorError) as refused:
            await state.tokenizing.ask(TOKENIZE_PATH, None, WORK, TokenizeResponse, "r1")
    assert refused.value.reason == reason and refused.value.retry_after == 7 and tried == []


async def test_a_workers_client_error_stands_and_no_other_worker_is_asked() -> None:
    async with pool({"w1": refusing(400, reasons.INVALID_REQUEST), "w2": refusing(500, reasons.INTERNAL)}) as (
            state, tried):
        with pytest.raises(CoordinatorError) as refused:
            await state.tokenizing.ask(TOKENIZE_PATH, None, WORK, TokenizeResponse, "r1")
        assert refused.value.reason == reasons.INVALID_REQUEST and tried == ["w1"]
        assert state.registry.get("w1").breaker_failures == 0  # type: ignore[union-attr]
