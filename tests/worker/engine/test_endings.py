"""The ending rules of a request with several choices: each choice ends on its own, the request once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from protocol import reasons
from protocol.worker import GenerateRequest
from worker.engine.channel import TokenChannel
from worker.engine.endings import Endings, Progress, also_ending, combined
from worker.engine.jobs import EngineConfig, EngineObserver, ExtraChoice, Failed, Finished, Job, StreamItem
from worker.sessions.table import Session


class Observer(EngineObserver):
    def __init__(self) -> None:
        self.finished_items: list[Finished | Failed] = []

    def finished(self, job: Job, item: Finished | Failed) -> None:
        self.finished_items.append(item)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def ended(reason: str, tokens: int, *, ttft: float = 1.0, total: float = 2.0) -> Finished:
    return Finished(reason=reason, prompt_tokens=10, cached_tokens=4, completion_tokens=tokens, queue_s=0.5,
                    prefill_s=0.5, ttft_s=ttft, total_s=total)


def three_choices(loop: asyncio.AbstractEventLoop) -> tuple[Job, list[Progress], Endings, Observer]:
    job = Job(request_id="r", request=GenerateRequest(prompt="go", n=3), session=Session(0, None, 0.0),
              prompt_tokens=[1, 2], cached_tokens=0, history=[], channel=TokenChannel[StreamItem](loop, 8),
              admitted_at=0.0, extra_choices=(ExtraChoice(1, Session(1, None, 0.0)), ExtraChoice(2, Session(2, None, 0.0))))
    observer = Observer()
    endings = Endings(EngineConfig(ctx_size=64, max_sessions=4, threads=1), observer, clock=lambda: 0.0)
    runs = [endings.begin(job, 0.0, choice) for choice in range(3)]
    return job, runs, endings, observer


async def drained(channel: TokenChannel[StreamItem]) -> list[StreamItem]:
    return [await channel.get() for _ in range(len(channel))]


def test_each_choice_runs_on_its_own_sequence(loop: asyncio.AbstractEventLoop) -> None:
    job, runs, _, _ = three_choices(loop)
    assert [run.session.seq_id for run in runs] == [0, 1, 2] and job.sessions == tuple(r.session for r in runs)


def test_the_request_ends_once_when_its_last_choice_has(loop: asyncio.AbstractEventLoop) -> None:
    job, runs, endings, observer = three_choices(loop)
    touched: set[TokenChannel[StreamItem]] = set()
    endings.deliver(runs[1], ended("stop", 3, ttft=0.8, total=1.5), touched)
    endings.deliver(runs[0], ended("length", 5), touched)
    assert not job.channel.closed and observer.finished_items == []
    endings.deliver(runs[2], ended("stop", 2, total=2.5), touched)
    [last] = loop.run_until_complete(drained(job.channel))
    assert isinstance(last, Finished) and job.channel.closed and observer.finished_items == [last]
    assert (last.reason, last.completion_tokens, last.prompt_tokens, last.cached_tokens) == ("length", 10, 10, 4)
    assert (last.ttft_s, last.total_s) == (0.8, 2.5)
    assert [(c.reason, c.completion_tokens) for c in last.choices] == [("length", 5), ("stop", 3), ("stop", 2)]


def test_a_failed_choice_ends_the_request_at_once_and_takes_the_others_with_it(
        loop: asyncio.AbstractEventLoop) -> None:
    job, runs, endings, observer = three_choices(loop)
    touched: set[TokenChannel[StreamItem]] = set()
    endings.deliver(runs[0], ended("stop", 3), touched)
    failure = Failed(reasons.SLOW_CONSUMER, "consumer stopped reading")
    assert also_ending(runs[1], failure, runs) == [runs[0], runs[2]]  # the backend ends the ones still running
    assert also_ending(runs[1], ended("stop", 1), runs) == []  # a choice that completes ends alone
    endings.deliver(runs[1], failure, touched)
    endings.deliver(runs[2], failure, touched)  # the others, ended with it, deliver nothing more
    assert loop.run_until_complete(drained(job.channel)) == [failure] and observer.finished_items == [failure]


@pytest.mark.parametrize(("choices", "reason"), [
    (("stop", "stop"), "stop"), (("stop", "length"), "length"), (("cancelled", "cancelled"), "cancelled"),
])
def test_the_request_ends_for_the_reason_its_choices_say(choices: tuple[str, ...], reason: str) -> None:
    assert combined([ended(r, 1) for r in choices]).reason == reason
