"""Placement: one attempt to place an admitted generation on a worker, and the rest of a stream whose worker
failed mid-stream.

Owns: admission's check, affinity's leaning, the scheduler's ranking, then dispatch, in that order (a long
prompt prefilled on one worker and decoded on another: relay/prefill.py), and what affinity remembers
after; a continuation's placement (relay/continuation.py): in turn, in its model's line ahead of new
requests of its class, on a worker its failed ones are left out of, within CONTINUATION_TIMEOUT.
Must not: enter stages or charge anything (a continuation is charged once, as the request it continues),
or claim a session's first turn (the gateway does, around `place`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from coordinator.admission.turn import in_turn
from coordinator.affinity.placement import Leaning
from coordinator.errors import CoordinatorError
from coordinator.generation import Generation
from coordinator.pool.registry import WorkerRecord
from coordinator.relay.dispatch import OpenStream, PrefixHints, PrefixPeer
from coordinator.relay.prefill import prefill_on
from coordinator.scheduling import Request
from protocol import reasons

if TYPE_CHECKING:
    from coordinator.state import CoordinatorState

Placed = Callable[[], None] | None


class Placement:
    def __init__(self, state: CoordinatorState) -> None:
        self._state = state

    async def place(self, gen: Generation, model: str | None, placed: Placed, holder: str | None = None
                    ) -> tuple[Generation, OpenStream]:
        """Admission's check, affinity's leaning, the scheduler's ranking, then dispatch in that order;
        `placed` runs once a worker's capacity is reserved for it, before that worker answers. `holder`: a
        live worker known to hold its cells (a continuation's draining one): the worker chosen is told it
        may fetch them from there."""
        state, body = self._state, gen.request
        affinity = state.affinity
        if affinity.session_worker(gen) is not None:
            # It continues a conversation: the worker already holds its sequence slot.
            gen = dataclasses.replace(gen, demand=dataclasses.replace(gen.demand, new_session=False))
        with gen.trace.step("placement"):  # admission's check, affinity and the policy's ranking
            state.admission.check(gen.demand, model, body.tenant)
            leaning = affinity.lean(gen, model, by_prefix=state.policy.uses("prefix"))
            decision = state.policy.select(
                Request(gen.demand, model, body.session_id, leaning.session_worker, leaning.prefer,
                        prefix_match=leaning.match, turn=next(state.turns), rng=state.rng),
                leaning.candidates, now=state.clock.monotonic())
        if decision.reason == reasons.UNKNOWN_SESSION:
            affinity.lost(gen.session_key)
            raise CoordinatorError(reasons.UNKNOWN_SESSION,
                                   f"session {body.session_id!r} lived on a worker that is gone; start a new one")
        if decision.reason is not None:
            raise CoordinatorError(decision.reason, f"no worker can take it now: {decision.reason}",
                                   retry_after=state.settings.retry_after)
        ranked = [w for w in (state.registry.get(v.worker_id) for v in decision.ranked) if w is not None]
        peer = self._peer(leaning, holder)
        if gen.disaggregated(state.settings.disaggregate_prompt_bytes, len(ranked)):
            # Prefill on the policy's first worker, decode on the others; without a finished prefill
            # the request goes to all of them as usual.
            first_placed, placed = placed, None  # the prefill runs with its own reservation

            def opens(part: Generation, workers: Sequence[WorkerRecord]) -> Awaitable[OpenStream]:
                return state.attempts.open(part, workers, reserved=first_placed)

            prefilled = await prefill_on(ranked[0], gen, opens, state.attempts.release,
                                         read_timeout=state.settings.worker_read_timeout)
            state.metrics.prefills.labels(outcome="failed" if prefilled is None else "prefilled").inc()
            if prefilled is not None:
                ranked, peer = ranked[1:], prefilled
        try:
            stream = await state.attempts.open(gen, ranked, reserved=placed,
                                                 hints=PrefixHints.of(leaning.hashes, peer))
        except CoordinatorError as exc:
            if exc.reason in (reasons.SESSION_EXPIRED, reasons.UNKNOWN_SESSION):
                affinity.lost(gen.session_key)
            raise
        affinity.placed(gen, model, stream.worker.worker_id, leaning)
        return gen, stream


    def _peer(self, leaning: Leaning, holder: str | None) -> PrefixPeer | None:
        """Where the worker chosen may fetch the prompt's cells instead of prefilling them: `holder` when it
        is known and alive, else the worker that was sent most of the prompt's prefix, if any was."""
        state = self._state
        holding = state.registry.get(holder) if holder is not None else None
        if holding is not None:
            return PrefixPeer(holding.worker_id, holding.url, 1.0, {})
        held = state.affinity.prefix_holder(leaning)
        return PrefixPeer(held[0].worker_id, held[0].url, held[1], leaning.match) if held is not None else None

    async def resume(self, gen: Generation, model: str | None, rank: int, choice: int, generated: list[int],
                     avoid: frozenset[str], waits: bool, holder: str | None) -> OpenStream:
        """The rest of `gen` (of its choice `choice`, alone, when it has several) after its worker failed
        mid-stream (or drains): the tokens its client has (`generated`) prefilled after its prompt on a
        worker not in `avoid`; placed in turn ahead of new requests of its class (`rank` + 1) when it
        `waits`, else tried once; a `CoordinatorError` when none took it (within CONTINUATION_TIMEOUT).
        `holder`: a live worker that holds its cells (a draining one). A kept session's first turn starts its
        session afresh where it goes on, with the prompt and all of the answer (its worker's copy is gone)."""
        state, rest = self._state, gen.continued(generated, avoid, choice)

        async def attempt(placed: Placed) -> OpenStream:
            return (await self.place(rest, model, placed, holder))[1]

        timeout = state.settings.continuation_timeout
        line = state.waiting.line(gen.request.model)
        try:
            async with asyncio.timeout(timeout):
                if not waits or not state.queue.enabled() or line is None:
                    return await attempt(None)
                return await in_turn(state.queue, line, attempt, started=state.clock.monotonic(),
                                     now=state.clock.monotonic, metrics=state.metrics, client_gone=None,
                                     tenant=gen.request.tenant, rank=rank + 1, waits=state.waiting.waits(line))
        except TimeoutError:
            raise CoordinatorError(reasons.QUEUE_TIMEOUT, f"no worker took it within {timeout:g} s "
                                   "(CONTINUATION_TIMEOUT)") from None
