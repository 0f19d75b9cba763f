"""The request's charge to its tenant's fair share (admission/fairness.py).

Owns: the tenant's weight sent to the worker with the request (its line orders prompts by it, and
with fair shares on, `fair_share`, it keeps headroom for the other tenants: worker/headroom.py), the
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
    def __init__(self, fair: FairShares, *, headroom: bool = False) -> None:
        """`headroom`: fair shares are on (with keys): the workers keep headroom for other tenants too."""
        self._fair = fair
        self._headroom = headroom

    def enter(self, entry: Entry[Generation]) -> Leaving:
        tenant = entry.work.request.tenant
        weight = self._fair.weight(tenant)
        if weight != 1.0 or self._headroom:  # the worker's line applies it too (worker/engine/line.py)
            entry.work = entry.work.weighted(weight, headroom=self._headroom)
        self._fair.arrive(tenant)
        entry.on_token = functools.partial(self._fair.charge_output, tenant)
        return Leaving(lambda _exc: self._fair.depart(tenant), functools.partial(self._ended, tenant))

    def _ended(self, tenant: str, end: End) -> None:
        if end.generated_tokens > end.relayed:
            self._fair.charge_output(tenant, end.generated_tokens - end.relayed)
        self._fair.depart(tenant)
        self._fair.ended(end.worker_id, tenant, end.prompt_tokens, end.generated_tokens)  # the worker reports it too
