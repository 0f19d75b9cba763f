"""Admission: the O(1) capacity check before a worker is chosen, and the in-flight KV reservations.

Owns: `check` (reads only the registry's aggregates: no loop over workers, so a rejection costs the
same with 1 or 1,000 workers), the reservation ledger and its running totals.
Must not: choose a worker (scheduling/) or talk to one (relay/dispatch.py).

A reservation lives from the moment a worker is chosen until its stream ends, whatever the ending.
It first holds the upper bound from `Demand.tokens`, then the exact size once the worker reports
the prompt's length in its `admitted` event (larger than the estimate too, when a chat template adds more than it allows).
It is released as soon as the stream's final event is read, before the client sees it, so a client
that sends its next request at once finds the slot free here as it is on the worker. It reaches the
scheduler through a registry correction on that worker, keyed by the reservation's key, which the
worker lists in its heartbeats while the stream holds a session (registry.py).
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.admission.demand import Demand
from coordinator.admission.fairness import FairShares
from coordinator.clock import Clock
from coordinator.errors import CoordinatorError
from coordinator.pool.registry import Correction, Registry, Totals, WorkerRecord
from protocol import reasons


@dataclass(slots=True)
class Reservation:
    key: int
    worker_id: str
    demand: Demand
    kv_bytes: int
    sessions: int
    released: bool = False
    held: tuple[str, str] | None = None  # (tenant, model) whose sequence count it adds to


class Admission:
    def __init__(self, registry: Registry, clock: Clock, *, retry_after: int,
                 on_release: Callable[[str], None] | None = None, fair: FairShares | None = None) -> None:
        """`fair`: the tenants' shares, for the headroom rule (`check`); None: no rule."""
        self._registry = registry
        self._fair = fair
        self._held: Counter[tuple[str, str]] = Counter()  # (tenant, model) -> new sequences reserved here
        self._clock = clock
        self._retry_after = retry_after
        self._on_release = on_release or (lambda model: None)  # capacity for that model may have freed
        # Stream references (X-Stream-Ref) start at a random point, so another coordinator's streams
        # on the same worker do not share them.
        self._keys = itertools.count(secrets.randbits(48))
        self.in_flight = 0
        self.in_flight_kv_bytes = 0

    def check(self, demand: Demand, model: str | None, tenant: str = "") -> None:
        """Raise a `CoordinatorError` when no alive worker can possibly take this request. O(1)."""
        self._registry.sweep(self._clock.monotonic())
        if self._registry.alive_count == 0:
            raise self._overloaded(reasons.NO_WORKERS, "no worker is alive")
        totals = self._registry.totals(model)
        if totals is None:
            if model is not None and self._registry.served_lately(model):
                raise self._overloaded(reasons.MODEL_UNAVAILABLE, f"no alive worker serves {model!r} now")
            raise CoordinatorError(reasons.UNKNOWN_MODEL, f"no worker serves model {model!r}")
        longest = totals.max_prompt_bytes
        if longest and 0 not in longest and demand.prompt_bytes > max(longest):
            # No token covers more bytes than the vocabulary's longest: this prompt cannot fit in any
            # session, and a worker would spend seconds tokenizing it to say so.
            raise CoordinatorError(reasons.PROMPT_TOO_LONG, f"the prompt's {demand.prompt_bytes} bytes cannot fit "
                                   f"in a session of this model (at most {max(longest)} bytes of text)")
        self._check_room(demand, model, tenant, totals)

    def _check_room(self, demand: Demand, model: str | None, tenant: str, totals: Totals) -> None:
        """A free sequence and the KV the request may need, or for an interactive request a batch
        request that some worker can park; the headroom rule with fair shares."""
        parking = demand.preempts and totals.preemptible >= max(1, demand.sessions)  # worker checks the KV
        if demand.sessions and totals.free_sessions < demand.sessions and not parking:
            raise self._overloaded(reasons.SESSIONS_FULL, "every worker's sessions are in use")
        if demand.sessions and model is not None and self._fair is not None:
            self._keep_headroom(tenant, model, totals.free_sessions - demand.sessions, totals.max_sessions)
        # Distinct values, not workers: one per model in practice.
        need = demand.tokens(max(totals.session_max_tokens)) * max(totals.bytes_per_token)
        if totals.free_kv_bytes < need and not parking:
            raise self._overloaded(reasons.KV_FULL, "not enough free KV cache on any worker")

    def _keep_headroom(self, tenant: str, model: str, left: int, total: int) -> None:
        """A tenant that already holds its weighted share of the model's sequences may not take one of
        the last free ones (one stays free per other active tenant, for its next request: that many
        idle sequences at most, when those tenants do not use them), nor any while a tenant below its
        share has requests waiting for the model at any coordinator (which that coordinator places as
        soon as the worker tells it of the free sequence). O(tenants waiting)."""
        assert self._fair is not None
        fair = self._fair
        if self._holds(tenant, model) < fair.share(tenant, total):
            return
        others = fair.others_active(tenant)
        if (others and left < others) or any(other != tenant and self._holds(other, model) < fair.share(other, total)
                                             for other in fair.waiting(model)):
            raise self._overloaded(reasons.SESSIONS_FULL, f"the free sequences of {model!r} are kept for other "
                                   "tenants: this key's tenant holds its share or more")

    def _holds(self, tenant: str, model: str) -> int:
        """The sequences of `model` `tenant` holds: ours reserved, or what the workers say, if more."""
        assert self._fair is not None
        return max(self._held[(tenant, model)], self._fair.running(tenant, model))

    def reserve(self, worker: WorkerRecord, demand: Demand, tenant: str = "") -> Reservation:
        kv_bytes = demand.tokens(worker.session_max_tokens) * worker.bytes_per_token
        res = Reservation(next(self._keys), worker.worker_id, demand, kv_bytes, demand.sessions)
        if demand.sessions:
            res.held = (tenant, worker.model)
            self._held[res.held] += demand.sessions
        self._registry.correct(res.worker_id, res.key, Correction(kv_bytes, res.sessions))
        worker.in_flight += 1
        worker.picked_at = self._clock.monotonic()
        self.in_flight += 1
        self.in_flight_kv_bytes += kv_bytes
        return res

    def confirm(self, res: Reservation, prompt_tokens: int | None) -> None:
        """The worker admitted it: shrink (or grow) the reservation to its exact size."""
        worker = self._registry.get(res.worker_id)
        if worker is not None and prompt_tokens is not None:
            # Exact, up or down: the worker has tokenized the templated prompt and admitted it at this
            # size, so a template longer than the estimate allowed grows the reservation too.
            exact = res.demand.exact_tokens(prompt_tokens, worker.session_max_tokens) * worker.bytes_per_token
            self.in_flight_kv_bytes += exact - res.kv_bytes
            res.kv_bytes = exact
        self._registry.correct(res.worker_id, res.key, Correction(res.kv_bytes, res.sessions))

    def release(self, res: Reservation, *, kept_tokens: int | None = None) -> None:
        """Idempotent; call it on every ending (done, error, client gone, worker gone, timeout).

        `kept_tokens`: the stream ended normally and its named session keeps that many tokens of
        KV on the worker, so the worker is not as free as the ended stream would suggest.
        """
        if res.released:
            return
        res.released = True
        if res.held is not None:
            self._held[res.held] -= res.sessions
            if self._held[res.held] <= 0:
                del self._held[res.held]
        self.in_flight -= 1
        self.in_flight_kv_bytes -= res.kv_bytes
        worker = self._registry.get(res.worker_id)
        if worker is not None:
            worker.in_flight = max(0, worker.in_flight - 1)
        try:
            kept = kept_tokens * worker.bytes_per_token if worker is not None and kept_tokens is not None else None
            self._registry.end(res.worker_id, res.key, self._clock.time(), kept_kv_bytes=kept)
        finally:
            if worker is not None:
                self._on_release(worker.model)

    def refused(self, res: Reservation, reason: str) -> None:
        """The worker refused `res`'s placement as full (`sessions_full`, `kv_full`): it knows of streams
        this coordinator does not (another coordinator's, or ones begun since its last report). Until
        its next heartbeat it counts here as full for such a request, so one waiting in the queue does
        not ask it again before then. Call it after `release(res)`."""
        self._registry.refused(res.worker_id, reason, res.kv_bytes)

    def _overloaded(self, reason: str, message: str) -> CoordinatorError:
        return CoordinatorError(reason, message, retry_after=self._retry_after)
