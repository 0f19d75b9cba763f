"""Headroom by tenant: the last free sequences of this worker kept for the tenants below their share.

Owns: which tenants are active on this worker (running here, waiting in its line with an interactive
request, or seen here within GRACE seconds: an interactive request of theirs arrived or ended; the
admission tells it which), their weights as their requests said (`GenerateRequest.tenant_weight`), and the rule: a
tenant that holds its weighted share of this worker's sequences or more may not take one of the last
free ones, one kept for each other active tenant below its share.
Must not: admit anything (worker/admission.py asks it before the session table) or order the line.

Why here as well as in the coordinator (coordinator/admission/capacity.py keeps the same headroom over
the pool): with several coordinators, each sees another's newest streams only at the worker's next
beat. One coordinator's flood fills the sequence another coordinator's light tenant was about to take,
and that tenant's next request waits for a flood's stream to end (seconds). The worker sees every
coordinator's streams as they start. It applies the rule only to requests whose coordinator keeps fair
shares (`GenerateRequest.fair_share`); a refused request waits in the room line like any refused for
capacity, and takes the next sequence that frees while it still fits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

# Seconds a tenant seen here (a request arrived or ended) stays active: a closed-loop client's or a
# chat's next request, which its coordinator may send to this worker or another, finds room here.
GRACE = 5.0
MAX_TENANTS = 1024  # tenants remembered, the least recently seen forgotten first


class Headroom:
    def __init__(self, sequences: int, clock: Callable[[], float], *, grace: float = GRACE) -> None:
        self._sequences = sequences
        self._clock = clock
        self._grace = grace
        self._seen: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (when, weight)

    def seen(self, tenant: str, weight: float = 1.0) -> None:
        """A request of `tenant` arrived here or ended here."""
        self._seen[tenant] = (self._clock(), weight)
        self._seen.move_to_end(tenant)
        while len(self._seen) > MAX_TENANTS:
            self._seen.popitem(last=False)

    def keeps(self, tenant: str, weight: float, need: int, running: Mapping[str, int],
              waiting: Iterable[str] = ()) -> bool:
        """Whether the `need` sequences `tenant` asks for are among those kept for others: it holds its
        share or more (`running`: sequences per tenant now) and taking them would leave fewer free than
        the other active tenants below their shares. O(tenants active)."""
        held = running.get(tenant, 0)
        active = self._active(running, waiting)
        active[tenant] = weight
        if len(active) < 2:
            return False
        weights = sum(active.values())
        if held < self._sequences * weight / weights:
            return False
        below = sum(1 for other, w in active.items()
                    if other != tenant and running.get(other, 0) < self._sequences * w / weights)
        free = self._sequences - sum(running.values())
        return free - need < below

    def _active(self, running: Mapping[str, int], waiting: Iterable[str]) -> dict[str, float]:
        """The active tenants and their weights (1 for one never seen)."""
        since = self._clock() - self._grace
        active: dict[str, float] = {}
        for t in reversed(self._seen):  # the most recently seen first: stops at the first seen too long ago
            at, w = self._seen[t]
            if at < since:
                break
            active[t] = w
        for tenant in (*(t for t, n in running.items() if n > 0), *waiting):
            if tenant not in active:
                active[tenant] = self._seen.get(tenant, (0.0, 1.0))[1]
        return active
