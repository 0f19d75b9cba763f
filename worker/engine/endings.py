"""The ending rules of a generating sequence, written once for every engine backend.

Owns: what ends a sequence and how: cancelled (its consumer left or its session was deleted,
whether it runs or still waits in the engine's inbox), past the request's deadline, a consumer that
stopped reading past the slow-consumer deadline, an end-of-generation token (unless `ignore_eos`),
a stop string, `max_tokens`, the session's KV reservation; the text a sequence streams (UTF-8
assembly and stop strings, `TextAssembler`); the `Finished` it reports; and, when it completed,
the assistant turn its session keeps. For a request of several choices (`n` > 1) each choice is a
sequence of its own that ends by these rules on its own; the request ends, with one terminal item
that accounts for them all, when the last one has; a choice that fails fails the request
(`also_ending`), since its stream can end only once.
Must not: touch llama.cpp or free KV; each backend releases its sequence (the llama.cpp engine frees
cells, the simulated one only the table) between `completed` and `deliver`, so the slot is free
before the consumer hears of the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from protocol import reasons
from worker.engine.channel import TokenChannel
from worker.engine.jobs import EngineConfig, EngineObserver, Failed, Finished, Job, StreamItem
from worker.engine.textstream import TextAssembler
from worker.sessions.messages import Message
from worker.sessions.table import Session

Touched = set[TokenChannel[StreamItem]]
P = TypeVar("P", bound="Progress")


@dataclass(eq=False)
class Progress:
    """One generating sequence, as the ending rules see it; a backend keeps its own state beside it."""

    job: Job
    text: TextAssembler
    started_at: float  # the engine took the job
    generated: int = 0
    output: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    choice: int = 0  # which of the job's choices this sequence generates
    ended: bool = False  # set by the backend when it ends the sequence (a sibling's failure may)
    session: Session = field(init=False)  # the choice's own sequence

    def __post_init__(self) -> None:
        self.session = self.job.session if self.choice == 0 else self.job.extra_choices[self.choice - 1].session
        if self.job.continued:  # a continuation (one choice): the answer so far counts and is kept
            self.generated = self.job.continued
            self.output.append(self.job.continued_text)


class Endings:
    def __init__(self, config: EngineConfig, observer: EngineObserver, clock: Callable[[], float]) -> None:
        self._config = config
        self._observer = observer
        self._clock = clock

    def begin(self, job: Job, started_at: float, choice: int = 0) -> Progress:
        return Progress(job=job, text=assembler(job, choice), started_at=started_at, choice=choice)

    def interrupted(self, run: Progress, now: float) -> Finished | Failed | None:
        """Before a step: the ending of a sequence cancelled or past its deadline, else None."""
        if run.job.channel.cancelled:
            return self.finished(run, "cancelled", now)
        if now - run.job.admitted_at > self._config.request_timeout:
            return Failed(reasons.DEADLINE_EXCEEDED, f"request ran past {self._config.request_timeout:g} s")
        return None

    def consumer(self, run: Progress, now: float) -> bool | Failed:
        """Before emitting: True when the consumer has room; False to wait a step; `Failed` when it has
        been full past the slow-consumer deadline."""
        channel = run.job.channel
        if channel.has_room():
            channel.full_since = None
            return True
        channel.full_since = channel.full_since or now
        if now - channel.full_since > self._config.slow_consumer_deadline:
            return Failed(reasons.SLOW_CONSUMER, "consumer stopped reading")
        return False

    def accept(self, run: Progress, piece: bytes, probability: float, touched: Touched, *,
               eog: bool = False, alternatives: tuple[tuple[str, float], ...] = (), now: float | None = None,
               gaps: list[float] | None = None, token: int = -1) -> str | None:
        """A generated token (`token`: its id, which pieces carry when the request asks for `token_ids`):
        its text goes to the consumer (held while it may begin a stop string); the finish reason when the
        sequence ends with it (`stop`, `length`), else None. A backend that accepts a step's tokens
        together gives the step's time (`now`) and a list that collects their gaps since each one's
        previous token (`gaps`, for the observer's `token_gaps` once a step)."""
        now = self._clock() if now is None else now
        if run.first_token_at is None:
            run.first_token_at = now
        elif gaps is None:
            self._observer.token_gap(now - run.last_token_at)
        else:
            gaps.append(now - run.last_token_at)
        run.last_token_at = now
        job = run.job
        if eog and not job.request.ignore_eos:
            return "stop"
        index = run.generated
        run.generated += 1
        for out in run.text.push(piece, index, probability, alternatives, token):
            run.output.append(out.text)
            job.channel.push(out)
            touched.add(job.channel)
        if run.text.stopped:
            return "stop"
        session = run.session
        if run.generated >= job.request.max_tokens or len(session.tokens) + 1 > session.reserved_tokens:
            return "length"
        return None

    def finished(self, run: Progress, reason: str, now: float | None = None) -> Finished:
        now = self._clock() if now is None else now
        job = run.job
        first = run.first_token_at if run.first_token_at is not None else now
        prompt = job.prompt_length  # a continuation's earlier tokens are completion tokens
        return Finished(reason=reason, prompt_tokens=prompt, cached_tokens=min(job.cached_tokens, prompt),
                        completion_tokens=run.generated, queue_s=max(0.0, run.started_at - job.admitted_at),
                        prefill_s=max(0.0, first - run.started_at), ttft_s=first - job.admitted_at,
                        total_s=now - job.admitted_at)

    def completed(self, run: Progress, outcome: Finished | Failed, touched: Touched) -> bool:
        """Whether the sequence completed (its session then keeps the turn): the held text is flushed
        and the assistant's answer joins the session's history."""
        if not isinstance(outcome, Finished) or outcome.reason == "cancelled":
            return False
        job = run.job
        for out in run.text.finish():
            run.output.append(out.text)
            job.channel.push(out)
            touched.add(job.channel)
        run.session.messages = [*job.history, Message("assistant", "".join(run.output))]
        return True

    def deliver(self, run: Progress, outcome: Finished | Failed, touched: Touched) -> None:
        """The terminal item, once the backend has released the sequence; with several choices, once
        the last one has ended (or at the first failure: the request fails as one)."""
        job = run.job
        if job.n > 1:
            if job.channel.closed:
                return  # a choice failed before this one ended: the request's end was delivered then
            if isinstance(outcome, Finished):
                job.ended[run.choice] = outcome
                if len(job.ended) < job.n:
                    return
                outcome = combined([job.ended[i] for i in range(job.n)])
        job.channel.push(outcome, terminal=True)
        touched.add(job.channel)
        self._observer.finished(job, outcome)


def assembler(job: Job, choice: int = 0) -> TextAssembler:
    """The text assembly of one choice of `job`: its stop strings, and token ids when the request asks.
    A continuation's starts empty: the text an earlier worker released never ends inside a stop string's
    start (it is held until it cannot be one), so a stop string still matches across the seam."""
    return TextAssembler(job.request.stop, choice=choice, ids=job.request.token_ids)


def combined(ends: list[Finished]) -> Finished:
    """The ending of a request from its choices' endings (in choice order): every choice's tokens, the
    prompt once, from the first token of any choice to the end of the last; `cancelled` if it was,
    else `length` if any choice ran out of tokens, else `stop`."""
    reasons_seen = {end.reason for end in ends}
    reason = next((r for r in ("cancelled", "length") if r in reasons_seen), "stop")
    first = ends[0]
    return Finished(reason=reason, prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens,
                    completion_tokens=sum(end.completion_tokens for end in ends), queue_s=first.queue_s,
                    prefill_s=first.prefill_s, ttft_s=min(end.ttft_s for end in ends),
                    total_s=max(end.total_s for end in ends), choices=tuple(ends))


def also_ending(run: Progress, outcome: Finished | Failed, running: Iterable[P]) -> list[P]:
    """The other sequences that end with `run`: its request's other choices when it failed (the
    request's stream ends once, with that error), none otherwise (each choice ends on its own)."""
    if run.job.n == 1 or not isinstance(outcome, Failed):
        return []
    return [other for other in running if other.job is run.job and other is not run and not other.ended]


def cancel_session(session: Session, running: Iterable[Job], queued: Iterable[Job]) -> None:
    """Cancels the job of `session`, running or still queued: a deleted session's queued request must
    not start after the delete answered."""
    for job in (*running, *queued):
        if job.session is session:
            job.channel.cancel()
