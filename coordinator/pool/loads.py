"""Loading a model on demand (issue 37): a request for a model that a worker offers from its folder but
none serves makes one worker swap to it, and waits in the admission queue's line for that model
(admission/turn.py: its bound, deadline, class and fair order), woken by heartbeats, until a worker
serves it.

Owns: choosing the worker that loads (among the alive ones offering it, one that loads it beside the
models it serves, unloading none (`OfferedModel.beside`: WORKER_MAX_MODELS), then the least busy: fewest
sessions and streams of this coordinator, then the smallest memory need), asking it (`POST /worker/models/load`),
one ask per model at a time (a burst of requests waits for that one load: asked again only once
ASK_AGAIN has passed without the model served, or BUSY_AGAIN after a worker said it is busy swapping to
another; none while a worker's heartbeats say it swaps to the model or away from it, nor of a worker
that finished a swap less than HOLD ago), a model that failed to load (its reason answered for the workers' own pause,
MODEL_LOAD_BACKOFF, then asked for again).
Must not: wait (the queue does), decide what a worker unloads (the worker swaps, waiting for its
streams), or admit anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from coordinator.errors import CoordinatorError
from coordinator.pool.registry import Registry, WorkerRecord
from coordinator.upstream import WorkerClient, WorkerUnreachable
from protocol import reasons
from protocol.worker import (
    MODEL_LOAD_BACKOFF,
    MODEL_LOAD_PATH,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    ErrorBody,
    ModelLoadRequest,
)

ASK_AGAIN = 120.0  # seconds after an ask the model is asked for again if no worker serves it by then
BUSY_AGAIN = 1.0  # the same after a worker answered that it swaps to another model
FAILED_AGAIN = MODEL_LOAD_BACKOFF  # and after its load failed: requests meanwhile get the failure
# Seconds a model swapped in keeps its worker (from the first heartbeat after the swap, which every
# coordinator sees) before an ask for another model may swap it away: its waiters are admitted first.
# Without it, a worker asked for two models at once swapped to one and back before the first one's
# waiters (then polling every 0.1 s) were let in: 24 of 940 requests timed out after 30 s in a 10-minute soak
# of two models on one worker (bench/model_soak.py).
HOLD = 2.0
ANSWER_LIMIT = 4096  # bytes of a worker's answer to an ask


@dataclass(slots=True)
class _Ask:
    worker_id: str
    again_at: float  # monotonic: when this model may be asked for again
    failed: str = ""  # the worker's reason the load failed; "" while none did


class ModelLoads:
    def __init__(self, registry: Registry, client: WorkerClient, *, now: Callable[[], float], retry_after: int = 1,
                 timeout: float = 5.0) -> None:
        """`client` carries the worker token (upstream.with_token)."""
        self._registry, self._client, self._now = registry, client, now
        self._headers = {"content-type": "application/json", PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
        self._retry_after, self._timeout = retry_after, timeout
        self._asks: dict[str, _Ask] = {}  # by model: at most one per model a worker offers
        self.asked = 0  # asks sent (the tests read it)

    async def wanted(self, model: str) -> None:
        """Returns when an alive worker serves `model`. Otherwise asks one to load it when an ask is due and
        raises 503 `loading`: the request waits in the queue's line for `model`, woken by the heartbeats,
        and calls again when woken. Raises `model_load_failed` while its last load's failure stands, and
        `model_unavailable` when no alive worker offers it (and none swaps to it or away from it)."""
        if serving(self._registry, model):
            self._asks.pop(model, None)
            return
        ask = self._asks.get(model)
        if ask is None or (self._now() >= ask.again_at and not self._failed(ask)):
            await self._ask(model)
            ask = self._asks.get(model)
        if ask is not None and self._failed(ask):
            raise CoordinatorError(reasons.MODEL_LOAD_FAILED, f"model {model!r} failed to load on "
                                   f"{ask.worker_id}: {ask.failed}")
        raise CoordinatorError(reasons.LOADING, f"model {model!r} is loading", retry_after=self._retry_after)

    def served(self, model: str) -> None:
        """A worker serves `model` now (its heartbeat says so): an ask for it is answered."""
        self._asks.pop(model, None)

    def _failed(self, ask: _Ask) -> bool:
        """Its load failed, and the workers' pause before the next try is not over."""
        return bool(ask.failed) and self._now() < ask.again_at

    def loading(self, model: str) -> bool:
        """This coordinator asked a worker to load `model`, and the load has not failed; or an alive
        worker's heartbeats say it swaps to it (whoever asked). O(alive workers) at most."""
        ask = self._asks.get(model)
        if ask is not None and not ask.failed:
            return True
        return any(w.swapping == model for w in self._registry.alive())

    async def _ask(self, model: str) -> None:
        worker = self._choose(model)
        if worker is None and self._registry.swap_involves(model):
            # A worker swaps to it, or away from it: wait for that swap, then ask (if still needed).
            self._asks[model] = _Ask("", self._now() + BUSY_AGAIN)
            return
        if worker is None:
            raise CoordinatorError(reasons.MODEL_UNAVAILABLE, f"no alive worker offers {model!r} now")
        if self._now() - worker.swap_ended < HOLD:
            # Its model was just swapped in (whoever asked): the requests that waited for it go in first.
            self._asks[model] = _Ask("", self._now())  # asked at the next try, after the next heartbeat
            return
        ask = self._asks[model] = _Ask(worker.worker_id, self._now() + ASK_AGAIN)
        self.asked += 1
        try:
            status, body = await self._client.exchange(
                "POST", worker.url.rstrip("/") + MODEL_LOAD_PATH, self._headers,
                ModelLoadRequest(model=model).model_dump_json().encode(), limit=ANSWER_LIMIT, timeout=self._timeout)
        except WorkerUnreachable:
            ask.again_at = self._now() + BUSY_AGAIN
            return
        if status in (200, 202):
            return
        reason, message = _refusal(body)
        if reason == reasons.MODEL_LOAD_FAILED:
            ask.failed, ask.again_at = message, self._now() + FAILED_AGAIN
        else:  # swapping to another model, still loading its first, or an answer not understood: later
            ask.again_at = self._now() + BUSY_AGAIN

    def _choose(self, model: str) -> WorkerRecord | None:
        offering = [(w, o) for w in self._registry.alive() for o in w.offered
                    if o.state == "offered" and o.name == model and (w.standby or not w.draining)]
        if not offering:
            return None
        worker, _ = min(offering, key=lambda wo: (not wo[1].beside, wo[0].sessions + wo[0].in_flight,
                                                 wo[1].need_bytes, wo[0].worker_id))
        return worker


def serving(registry: Registry, model: str) -> bool:
    """Some alive worker serves `model` and is not draining (a worker swapping away from it drains)."""
    return any(not w.draining for w in registry.alive(model))


def _refusal(body: bytes) -> tuple[str, str]:
    try:
        refused = ErrorBody.model_validate_json(body)
    except ValidationError:
        return reasons.WORKER_FAILED, json.dumps(body[:200].decode("utf-8", "replace"))
    return refused.reason, refused.error
