"""Loading a model on demand (issue 37): a request for a model that a worker offers from its folder but
none serves makes one worker swap to it, and waits, with its deadline, until a worker serves it.

Owns: choosing the worker that loads (among the alive ones offering it, one that loads it beside the
models it serves, unloading none (`OfferedModel.beside`: WORKER_MAX_MODELS), then the least busy: fewest
sessions and streams of this coordinator, then the smallest memory need), asking it (`POST /worker/models/load`),
one ask per model at a time (a burst of requests waits for that one load: asked again only once
ASK_AGAIN has passed without the model served, or BUSY_AGAIN after a worker said it is busy swapping to
another; none while a worker's heartbeats say it swaps to the model or away from it, nor of a worker
that finished a swap less than HOLD ago), a model that failed to load (its reason answered for the workers' own pause,
MODEL_LOAD_BACKOFF, then asked for again), and the wait itself: bounded in count (`waiting`, at most
`queue_size` a model) and in time (the queue's timeout).
Must not: decide what a worker unloads (the worker swaps, waiting for its streams), or admit anything.
"""

from __future__ import annotations

import asyncio
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
POLL = 0.1  # seconds between looks at the registry while a request waits for its model
# Seconds a model swapped in keeps its worker (from the first heartbeat after the swap, which every
# coordinator sees) before an ask for another model may swap it away: its waiters are admitted first.
# Without it, a worker asked for two models at once swapped to one and back before the first one's
# waiters (polling every POLL) were let in: 24 of 940 requests timed out after 30 s in a 10-minute soak
# of two models on one worker (bench/model_soak.py).
HOLD = 2.0
ANSWER_LIMIT = 4096  # bytes of a worker's answer to an ask


@dataclass(slots=True)
class _Ask:
    worker_id: str
    again_at: float  # monotonic: when this model may be asked for again
    failed: str = ""  # the worker's reason the load failed; "" while none did


class ModelLoads:
    def __init__(self, registry: Registry, client: WorkerClient, *, now: Callable[[], float], queue_size: int,
                 timeout: float = 5.0) -> None:
        """`client` carries the worker token (upstream.with_token)."""
        self._registry, self._client, self._now = registry, client, now
        self._headers = {"content-type": "application/json", PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
        self._queue_size, self._timeout = queue_size, timeout
        self._asks: dict[str, _Ask] = {}  # by model: at most one per model a worker offers
        self._waiting: dict[str, int] = {}
        self.asked = 0  # asks sent (the tests read it)

    async def until_served(self, model: str, deadline: float) -> None:
        """Returns once a worker serves `model` (offered, not served, when called), asking for its load;
        `CoordinatorError` when it is not served by `deadline` (`queue_timeout`), its load failed
        (`model_load_failed`), or too many requests wait for it already (`queue_full`)."""
        if self._waiting.get(model, 0) >= self._queue_size:
            raise CoordinatorError(reasons.QUEUE_FULL, f"{self._queue_size} requests wait for {model!r} to load")
        self._waiting[model] = self._waiting.get(model, 0) + 1
        try:
            while not serving(self._registry, model):
                ask = self._asks.get(model)
                if ask is not None and ask.failed and self._now() < ask.again_at:
                    raise CoordinatorError(reasons.MODEL_LOAD_FAILED, f"model {model!r} failed to load on "
                                           f"{ask.worker_id}: {ask.failed}")
                if ask is None or self._now() >= ask.again_at:
                    await self._ask(model)
                if self._now() >= deadline:
                    raise CoordinatorError(reasons.QUEUE_TIMEOUT, f"model {model!r} was not loaded in time")
                await asyncio.sleep(POLL)
        finally:
            self._waiting[model] -= 1
            if not self._waiting[model]:
                del self._waiting[model]
        self._asks.pop(model, None)

    def loading(self, model: str) -> bool:
        """This coordinator asked a worker to load `model`, which has not failed, and waits for it now; or
        an alive worker's heartbeats say it swaps to it (whoever asked). O(alive workers) at most."""
        ask = self._asks.get(model)
        if ask is not None and not ask.failed and model in self._waiting:
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
            self._asks[model] = _Ask("", self._now() + POLL)
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
