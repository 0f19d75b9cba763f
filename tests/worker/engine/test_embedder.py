"""The embedder's thread without a model: packing, the bounded queue, deadlines, supervision, and an
event loop that never waits on a computation."""

from __future__ import annotations

import asyncio
import base64
import random
import threading
import time

import numpy as np
import pytest

from worker.engine.embedder import Embedder, EmbeddingObserver, pack
from worker.errors import WorkerError


class FakeContext:
    """Vectors that say which input they came from ([length, first token, 0], normalised); `gate`, when
    given, holds every batch until it is set; an input starting with token 0 makes the batch fail."""

    dimensions, max_tokens, max_inputs, pooling = 3, 10, 2, "mean"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.batches: list[list[list[int]]] = []
        self.closed = False

    def embed(self, inputs: list[list[int]]) -> list[bytes]:
        assert len(inputs) <= self.max_inputs and sum(map(len, inputs)) <= self.max_tokens
        if self.gate is not None:
            assert self.gate.wait(10)
        self.batches.append(inputs)
        if any(tokens[0] == 0 for tokens in inputs):
            raise RuntimeError("injected fault")
        out = []
        for tokens in inputs:
            v = np.array([len(tokens), tokens[0], 0.0])
            out.append((v / np.linalg.norm(v)).astype("<f4").tobytes())
        return out

    def close(self) -> None:
        self.closed = True


class Recorder(EmbeddingObserver):
    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []
        self.errors: list[str] = []

    def embedding_batch(self, inputs: int, tokens: int, seconds: float) -> None:
        self.batches.append((inputs, tokens))

    def internal_error(self, task: str) -> None:
        self.errors.append(task)


def tokens_of(text: str) -> list[int]:
    """One token per character: its digit value ("0" is token 0, which the fake context fails on)."""
    return [int(c) for c in text]


def embedder(context: FakeContext, *, capacity: int = 4, timeout: float = 5.0,
             observer: EmbeddingObserver | None = None) -> Embedder:
    found = Embedder(context, tokens_of, capacity=capacity, timeout=timeout, observer=observer)
    found.start()
    return found


def vector(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


@pytest.mark.parametrize("lengths, max_tokens, max_inputs, batches", [
    ([], 10, 4, []),
    ([3], 10, 4, [(0, 1)]),
    ([3, 3, 3, 3], 6, 4, [(0, 2), (2, 4)]),  # the token bound
    ([1, 1, 1, 1, 1], 10, 2, [(0, 2), (2, 4), (4, 5)]),  # the input bound
    ([10, 1, 9, 1], 10, 4, [(0, 1), (1, 3), (3, 4)]),  # exactly full batches
    ([2, 9, 2], 10, 4, [(0, 1), (1, 2), (2, 3)]),  # in order: the last 2 does not join the first
])
def test_pack_groups_consecutive_inputs_within_both_bounds(lengths: list[int], max_tokens: int, max_inputs: int,
                                                           batches: list[tuple[int, int]]) -> None:
    found = pack(lengths, max_tokens=max_tokens, max_inputs=max_inputs)
    assert [(r.start, r.stop) for r in found] == batches


def test_pack_covers_every_input_once_in_order_and_never_splits_a_batch_that_could_grow() -> None:
    rng = random.Random(7)
    for _ in range(2_000):
        max_tokens, max_inputs = rng.randint(1, 40), rng.randint(1, 6)
        lengths = [rng.randint(1, max_tokens) for _ in range(rng.randint(0, 30))]
        batches = pack(lengths, max_tokens=max_tokens, max_inputs=max_inputs)
        assert [i for r in batches for i in r] == list(range(len(lengths)))
        for r, after in zip(batches, [*batches[1:], None], strict=False):  # empty: no batch
            assert len(r) <= max_inputs and sum(lengths[i] for i in r) <= max_tokens
            if after is not None:  # greedy: the next input would not have fitted
                assert len(r) == max_inputs or sum(lengths[i] for i in r) + lengths[after.start] > max_tokens


def test_one_vector_per_input_in_order_in_as_few_decodes_as_fit() -> None:
    context, observer = FakeContext(), Recorder()
    found = embedder(context, observer=observer)
    try:
        done = asyncio.run(found.embed(["12", "345", "6", "7777777"]))
    finally:
        found.stop()
    assert done.tokens == [2, 3, 1, 7] and done.dimensions == 3
    # Each vector says which input it is: [length, first token, 0], normalised.
    for text, b64 in zip(["12", "345", "6", "7777777"], done.vectors, strict=True):
        expected = np.array([len(text), int(text[0]), 0.0])
        assert np.allclose(vector(b64), expected / np.linalg.norm(expected), atol=1e-6)
    # Bounds 10 tokens and 2 inputs: [12, 345] then [6, 7777777].
    assert context.batches == [[[1, 2], [3, 4, 5]], [[6], [7] * 7]]
    assert observer.batches == [(2, 5), (2, 8)]
    assert found.held == 0 and context.closed


def test_an_input_longer_than_the_context_is_refused_whole_and_nothing_is_computed() -> None:
    context = FakeContext()
    found = embedder(context)
    try:
        with pytest.raises(WorkerError) as refused:
            asyncio.run(found.embed(["1", "12345678912"]))
    finally:
        found.stop()
    assert (refused.value.status, refused.value.reason) == (413, "prompt_too_long")
    assert "input 1 is 11 tokens" in refused.value.message and context.batches == []


def test_past_capacity_a_request_is_refused_at_once_and_the_held_ones_finish() -> None:
    gate = threading.Event()
    context = FakeContext(gate)
    found = embedder(context, capacity=2)

    async def scenario() -> tuple[list[object], float]:
        held = [asyncio.create_task(found.embed([str(i)])) for i in (1, 2)]
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(WorkerError) as refused:
            await found.embed(["3"])
        took = time.monotonic() - started
        assert (refused.value.status, refused.value.reason) == (503, "embeddings_full")
        gate.set()
        return list(await asyncio.gather(*held)), took

    try:
        answers, took = asyncio.run(scenario())
    finally:
        found.stop()
    assert took < 0.5 and len(answers) == 2 and found.held == 0
    assert context.batches == [[[1]], [[2]]]  # the refused one never reached the context


def test_past_its_deadline_a_request_gets_504_and_its_queued_successor_is_skipped_not_computed() -> None:
    gate = threading.Event()
    context = FakeContext(gate)
    found = embedder(context, timeout=0.3)

    async def scenario() -> list[BaseException | object]:
        return await asyncio.gather(found.embed(["1"]), found.embed(["2"]), return_exceptions=True)

    try:
        answers = asyncio.run(scenario())
        gate.set()
        deadline = time.monotonic() + 5
        while found.held and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        found.stop()
    assert all(isinstance(a, WorkerError) and a.status == 504 and a.reason == "deadline_exceeded" for a in answers)
    assert context.batches == [[[1]]] and found.held == 0  # the second was abandoned before its turn


def test_a_failing_batch_fails_its_request_only_and_the_thread_goes_on() -> None:
    observer = Recorder()
    found = embedder(FakeContext(), observer=observer)
    try:
        with pytest.raises(WorkerError) as failed:
            asyncio.run(found.embed(["05"]))
        served = asyncio.run(found.embed(["5"]))
    finally:
        found.stop()
    assert (failed.value.status, failed.value.reason) == (500, "engine_failed")
    assert observer.errors == ["embeddings"] and served.tokens == [1]


def test_the_event_loop_runs_on_while_a_batch_computes() -> None:
    gate = threading.Event()
    found = embedder(FakeContext(gate))

    async def scenario() -> int:
        ticks = 0
        task = asyncio.create_task(found.embed(["1"]))
        for _ in range(20):
            await asyncio.sleep(0.005)
            ticks += 1
        assert not task.done()  # still computing, and the loop kept ticking
        gate.set()
        await task
        return ticks

    try:
        assert asyncio.run(scenario()) == 20
    finally:
        found.stop()


def test_stop_refuses_the_waiting_requests_with_draining() -> None:
    gate = threading.Event()
    found = embedder(FakeContext(gate), capacity=3)

    async def scenario() -> list[BaseException | object]:
        tasks = [asyncio.create_task(found.embed([str(i)])) for i in (1, 2, 3)]
        await asyncio.sleep(0.05)
        stopping = asyncio.create_task(asyncio.to_thread(found.stop))
        await asyncio.sleep(0.05)
        gate.set()
        await stopping
        return await asyncio.gather(*tasks, return_exceptions=True)

    answers = asyncio.run(scenario())
    assert not isinstance(answers[0], BaseException)  # the running one finished
    assert all(isinstance(a, WorkerError) and a.reason == "draining" for a in answers[1:])
    with pytest.raises(WorkerError):
        asyncio.run(found.embed(["1"]))


class SlowContext(FakeContext):
    """Embeds at about `rate` tokens a second."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def embed(self, inputs: list[list[int]]) -> list[bytes]:
        time.sleep(sum(map(len, inputs)) / self.rate)
        return super().embed(inputs)


def oversized(found: Embedder) -> tuple[WorkerError, float]:
    """20 inputs of 9 tokens (180 tokens, 1.8 s at 100 a second) against a 1 s deadline: the refusal,
    and how long it took."""
    started = time.monotonic()
    with pytest.raises(WorkerError) as refused:
        asyncio.run(found.embed(["123456789"] * 20))
    assert (refused.value.status, refused.value.reason) == (413, "prompt_too_long")
    return refused.value, time.monotonic() - started


def test_a_request_it_cannot_embed_within_its_deadline_at_the_measured_rate_is_refused_before_any_work() -> None:
    """Issue 33: the largest request the pool accepts ran 30 s on each worker and was answered 504 or 502;
    at 100 tokens a second and a 1 s deadline, 180 tokens cannot be done: 413 at once, nothing computed."""
    context = SlowContext(rate=100)
    found = embedder(context, timeout=1.0)
    try:
        asyncio.run(found.embed(["1234", "5678"]))  # measures the rate
        assert found.rate is not None and 50 < found.rate < 110
        done_before = len(context.batches)
        refused, took = oversized(found)
    finally:
        found.stop()
    assert "180 tokens" in refused.message and "fewer inputs" in refused.message
    assert len(context.batches) == done_before and took < 0.5


def test_the_first_request_measures_the_rate_and_is_refused_after_its_first_batch_not_at_its_deadline() -> None:
    context = SlowContext(rate=100)
    found = embedder(context, timeout=1.0)
    try:
        _, took = oversized(found)
    finally:
        found.stop()
    assert len(context.batches) == 1 and took < 0.6  # one batch (0.09 s here), not the 1 s deadline
