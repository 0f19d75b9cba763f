"""Fair shares between tenants: each tenant's Virtual Token Counter, after "Fairness in Serving Large
Language Models" (Sheng et al., OSDI 2024).

Owns: each tenant's counter of weighted service, its charges (the prompt's tokens when a worker admits
the request, each generated token as it is relayed), the tenants' weights, which tenants are active
(a request of theirs waits or runs here), the lift of a tenant that returns from idle, and `Lowest`,
which finds the tenant with the lowest counter among a set.
Must not: hold requests (queue.py does), or decide whether a request fits (capacity.py does).

A tenant's counter grows by `(prompt_weight x prompt tokens + output_weight x generated tokens) /
weight`. Wherever requests wait, the tenant with the lowest counter goes next, so backlogged tenants
get service in proportion to their weights. A tenant that becomes active again is lifted to the
lowest counter among the active ones (or, when none is active, to the counter of the last one that
was), so idling banks no credit. Counters only grow: that is what lets `Lowest` keep its heap lazily.

Order alone is not enough when every sequence is held: the tenant whose turn it is would still wait
for a sequence to end, and a flood's streams, started together, end together. So admission
(capacity.py) keeps headroom: a tenant that holds its weighted share of a model's sequences or more
may not take one of the last free ones while other tenants are active (`others_active`, `share`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping

# A heap may hold this many entries per member, plus a few, before it is rebuilt: stale entries (of
# members that left) are otherwise dropped only when they reach the top.
_STALE_SLACK = 2


class Lowest:
    """The member with the lowest counter, found in O(log members) amortized.

    Each member has one live entry `(counter when pushed, order, name)`. Since counters only grow, an
    entry's value is never above its member's counter: the top is checked against the counter and, if
    it grew, pushed down again until the top is current. Ties go to the member added first."""

    __slots__ = ("_counter", "_heap", "_members", "_order")

    def __init__(self, counter: Callable[[str], float]) -> None:
        self._counter = counter
        self._heap: list[tuple[float, int, str]] = []
        self._members: dict[str, int] = {}  # name -> its live entry's order
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def add(self, name: str) -> None:
        if name in self._members:
            return
        order = next(self._order)
        self._members[name] = order
        heapq.heappush(self._heap, (self._counter(name), order, name))

    def discard(self, name: str) -> None:
        if self._members.pop(name, None) is not None and len(self._heap) > _STALE_SLACK * len(self._members) + 8:
            self._heap = [entry for entry in self._heap if self._members.get(entry[2]) == entry[1]]
            heapq.heapify(self._heap)

    def lowest(self) -> str | None:
        heap = self._heap
        while heap:
            value, order, name = heap[0]
            if self._members.get(name) != order:
                heapq.heappop(heap)  # it left
                continue
            now = self._counter(name)
            if now > value:
                heapq.heapreplace(heap, (now, order, name))  # served since it was pushed
                continue
            return name
        return None


class FairShares:
    """The tenants' counters. Without keys there is one tenant (""), and every order is arrival order."""

    def __init__(self, *, prompt_weight: float = 1.0, output_weight: float = 2.0,
                 weights: Mapping[str, float] | None = None) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self._weights = dict(weights or {})
        self._counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant -> its requests waiting or running here
        self._active_weight = 0.0  # the active tenants' weights, summed
        self._lowest_active = Lowest(self.counter)
        self._idle_floor = 0.0  # the counter of the last tenant that was active

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def active(self, tenant: str) -> int:
        return self._active.get(tenant, 0)

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` is here (it waits or runs until `depart`). A tenant that had none is
        lifted to the lowest active counter: what it did not use while idle is not saved up."""
        held = self._active.get(tenant, 0)
        if held == 0:
            other = self._lowest_active.lowest()
            floor = self._idle_floor if other is None else self.counter(other)
            if floor > self.counter(tenant):
                self._counters[tenant] = floor
            self._lowest_active.add(tenant)
            self._active_weight += self.weight(tenant)
        self._active[tenant] = held + 1

    def depart(self, tenant: str) -> None:
        held = self._active.get(tenant, 0) - 1
        if held > 0:
            self._active[tenant] = held
            return
        if self._active.pop(tenant, None) is not None:
            self._active_weight -= self.weight(tenant)
        self._lowest_active.discard(tenant)
        if not self._active:
            self._active_weight = 0.0  # no drift from float sums
            self._idle_floor = max(self._idle_floor, self.counter(tenant))

    def others_active(self, tenant: str) -> int:
        """How many tenants besides `tenant` have a request waiting or running here."""
        return len(self._active) - (tenant in self._active)

    def share(self, tenant: str, total: int) -> float:
        """`tenant`'s weighted share of `total` (sequences) among the active tenants, itself included."""
        weight = self.weight(tenant)
        active = self._active_weight + (0.0 if tenant in self._active else weight)
        return total * weight / active

    def charge_prompt(self, tenant: str, tokens: int) -> None:
        self._charge(tenant, self.prompt_weight * tokens)

    def charge_output(self, tenant: str, tokens: int = 1) -> None:
        self._charge(tenant, self.output_weight * tokens)

    def _charge(self, tenant: str, cost: float) -> None:
        if cost > 0:
            self._counters[tenant] = self._counters.get(tenant, 0.0) + cost / self.weight(tenant)
