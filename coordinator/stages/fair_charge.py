"""The request's charge to its tenant's fair share (admission/fairness.py).

Owns: the tenant's weight sent to the worker with the request (its line orders prompts by it), the
tenant's being active from the request's arrival to its end (`arrive`, `depart`), each token
charged as it is relayed (`Entry.on_token`), the tokens its usage counts beyond those relayed (a token
event may carry several tokens) charged at its end, and what it ran reported as ended on its worker.
Must not: order the queue (queue.py reads the counters) or admit anything.
"""

from __future__ import annotations

import functools

from coordinator.admission.fairness import FairShares
from coordinator.generation import Generation
from coordinator.stages import End, Entry, Leaving


class FairCharge:
    def __init__(self, fair: FairShares) -> None:
        self._fair = fair

    def enter(self, entry: Entry[Generation]) -> Leaving:
        tenant = entry.work.request.tenant
        weight = self._fair.weight(tenant)
        if weight != 1.0:  # the worker's line applies it too (worker/engine/line.py)
            entry.work = entry.work.weighted(weight)
        self._fair.arrive(tenant)
        entry.on_token = functools.partial(self._fair.charge_output, tenant)
        return Leaving(lambda _exc: self._fair.depart(tenant), functools.partial(self._ended, tenant))

    def _ended(self, tenant: str, end: End) -> None:
        if end.generated_tokens > end.relayed:
            self._fair.charge_output(tenant, end.generated_tokens - end.relayed)
        self._fair.depart(tenant)
        self._fair.ended(end.worker_id, tenant, end.prompt_tokens, end.generated_tokens)  # the worker reports it too
