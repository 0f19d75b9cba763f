"""The tokenizer's path behind the gateway (`/tokenize`, `/detokenize`, `/tokenizer_info`): the model a
request names, its workers chosen by the tokenizer's policy, and tried in turn by the one loop of tries.

Owns: resolving the model (pool/models.py; the work renamed for a stand-in), the choice of workers
(scheduling's `Policy.build_tokenizer`: alive, of the model, not draining, breaker closed; the fewest
of this coordinator's streams first), at most ATTEMPTS tries (attempts.Tries: the next worker when one
does not answer or refuses with 503, each worker judged as for any request), and the refusal once no
worker answered.
Must not: admit, queue or reserve anything: tokenizing holds no sequence and no KV. Nor parse a public
body (surfaces/tokenizer.py does) or speak to workers (relay/tokens.py does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from coordinator.admission.demand import Demand
from coordinator.attempts import Attempt, Failovers, Tries
from coordinator.errors import CoordinatorError
from coordinator.pool.models import resolve_model, stand_in
from coordinator.pool.registry import Registry, WorkerRecord
from coordinator.relay.tokens import TokenizerDispatcher
from coordinator.scheduling import Policy, Request
from coordinator.settings import Settings
from protocol import reasons
from serving.tracing import NO_TRACE

ATTEMPTS = 2  # workers asked at most: a tokenizer answers fast or its worker is in trouble
NO_DEMAND = Demand(prompt_bytes=0, max_tokens=0, new_session=False)  # what the scheduler's `Request` needs


@dataclass(frozen=True, slots=True)
class Tokenized:
    answer: dict[str, Any]  # the worker's answer, checked, as it came
    worker_id: str


class Tokenizing:
    def __init__(self, registry: Registry, policy: Policy, tries: Tries, dispatcher: TokenizerDispatcher,
                 settings: Settings, *, now: Callable[[], float]) -> None:
        self._registry = registry
        self._policy = policy
        self._tries = tries
        self._dispatcher = dispatcher
        self._settings = settings
        self._now = now

    async def ask(self, path: str, named: str | None, work: BaseModel, answer: type[BaseModel],
                  request_id: str) -> Tokenized:
        """`work` posted to `path` of the first worker of the model `named` (None: the default) that
        answers: its answer, checked as an `answer`; or the `CoordinatorError` that says why not."""
        settings = self._settings
        model = resolve_model(self._registry, settings.default_model, named, any_name=settings.any_model_name)
        if (name := stand_in(self._registry, named, model)) is not None and "model" in type(work).model_fields:
            work = work.model_copy(update={"model": name})
        ranked = self._ranked(model)
        payload = work.model_dump_json(exclude_none=True).encode()

        async def tried(at: Attempt) -> Tokenized:
            checked = await self._dispatcher.ask(at.worker, path, payload, answer, request_id=request_id,
                                                 traceparent=at.traceparent)
            return Tokenized(checked, at.worker.worker_id)

        return await self._tries.first(ranked, tried, at_most=ATTEMPTS, request_id=request_id, trace=NO_TRACE,
                                       exhausted=self._unanswered, logged={"tokenizer": path})

    def _ranked(self, model: str | None) -> list[WorkerRecord]:
        """The model's workers that take requests now, in the tokenizer policy's order."""
        decision = self._policy.select(Request(NO_DEMAND, model), self._registry.alive(model), now=self._now())
        ranked = [w for w in (self._registry.get(v.worker_id) for v in decision.ranked) if w is not None]
        if not ranked:
            raise CoordinatorError(reasons.NO_WORKERS if model is None else reasons.MODEL_UNAVAILABLE,
                                   "no alive worker serves this model now", retry_after=self._settings.retry_after)
        return ranked

    def _unanswered(self, failed: Failovers) -> CoordinatorError:
        """No worker answered: `worker_unavailable` naming the last one's reason, with the coordinator's
        Retry-After, whether the workers failed or refused."""
        last = failed.last.reason if failed.last is not None else reasons.WORKER_UNAVAILABLE
        return CoordinatorError(reasons.WORKER_UNAVAILABLE, f"no worker of the model answered ({last}); try again",
                                retry_after=self._settings.retry_after)
