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

With several coordinators the counters must not split by coordinator: each would be fair over its
own share of a tenant's traffic only. So every worker reports, in each heartbeat, what each tenant has
running there and what it has served each tenant in all (`protocol.health.TenantUse`). A coordinator
adds to a tenant's counter what that worker served it since its last beat, less what this
coordinator's own requests that ended there were served (`beat`, `ended`): the service the others
gave. And a tenant running anywhere counts as active here (for the lift and for headroom), and holds
the sequences the workers say it holds (`running`). The bound, per tenant: a counter lags the pool's
by what the others served it since each worker's last beat (a worker beats at once when a sequence
frees, with several coordinators); a request of ours whose end a worker reports before we read it, or
that we stopped reading (its client gone), is counted twice, its tokens once more, and no more.

Order alone is not enough when every sequence is held: the tenant whose turn it is would still wait
for a sequence to end, and a flood's streams, started together, end together. So admission
(capacity.py) keeps headroom: a tenant that holds its weighted share of a model's sequences or more
may not take one of the last free ones while other tenants are active (`others_active`, `share`).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from protocol.health import TenantUse

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


@dataclass(slots=True)
class _WorkerReport:
    """What one worker last said of each tenant, and what our own requests that ended there since
    were served (not yet seen in its counters)."""

    model: str
    served: dict[str, tuple[int, int]]  # tenant -> (prompt, generated) tokens, in all
    running: dict[str, int]
    ours: Counter[tuple[str, int]]  # (tenant, 0 prompt | 1 generated) -> tokens
    waiting: frozenset[str] = frozenset()  # tenants some coordinator said wait for its model


class FairShares:
    """The tenants' counters. Without keys there is one tenant (""), and every order is arrival order."""

    def __init__(self, *, prompt_weight: float = 1.0, output_weight: float = 2.0,
                 weights: Mapping[str, float] | None = None, idle_grace: float = 0.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        """`idle_grace`: seconds a tenant whose last request here ended still counts as active (its
        next request, a closed-loop client's or a chat's next turn, finds the headroom kept for it)."""
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self._idle_grace = idle_grace
        self._now = now
        self._lingering: OrderedDict[str, float] = OrderedDict()  # tenant -> when its last request here ended
        self._weights = dict(weights or {})
        self._counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant -> its requests waiting or running here
        self._active_weight = 0.0  # the weights of the tenants active here or running elsewhere, summed
        self._lowest_active = Lowest(self.counter)  # those same tenants
        self._idle_floor = 0.0  # the counter of the last tenant that was active
        self._reports: dict[str, _WorkerReport] = {}  # by worker id
        # tenant -> model -> the sequences the workers say it runs (ours too): a tenant in it runs somewhere
        self._running: dict[str, Counter[str]] = {}
        self._waiting: dict[str, Counter[str]] = {}  # model -> tenant -> the workers saying it waits for it

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def counters(self) -> dict[str, float]:
        """Every tenant's counter (one per tenant served: bounded by the keys)."""
        return dict(self._counters)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def _is_active(self, tenant: str) -> bool:
        return tenant in self._active or tenant in self._lingering or tenant in self._running

    def _expire(self) -> None:
        """Tenants whose grace after their last request ran out are active no longer (unless they run
        elsewhere). O(those expiring): the lingering are kept in the order they left."""
        deadline = self._now() - self._idle_grace
        while self._lingering:
            tenant, left = next(iter(self._lingering.items()))
            if left > deadline:
                return
            del self._lingering[tenant]
            if tenant not in self._running:
                self._deactivate(tenant)

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` is here (it waits or runs until `depart`). A tenant that was active
        nowhere is lifted to the lowest active counter: what it did not use while idle is not saved up."""
        self._expire()
        if self._lingering.pop(tenant, None) is None and not self._is_active(tenant):
            self._lift(tenant)
            self._activate(tenant)
        self._active[tenant] = self._active.get(tenant, 0) + 1

    def _lift(self, tenant: str) -> None:
        """`tenant` becomes active (here, or on a worker for another coordinator): up to the lowest
        active counter, or, when none is active, to the last active one's."""
        other = self._lowest_active.lowest()
        floor = self._idle_floor if other is None else self.counter(other)
        if floor > self.counter(tenant):
            self._counters[tenant] = floor

    def depart(self, tenant: str) -> None:
        held = self._active.get(tenant, 0) - 1
        if held > 0:
            self._active[tenant] = held
            return
        self._active.pop(tenant, None)
        if self._idle_grace > 0:
            self._lingering[tenant] = self._now()
        elif tenant not in self._running:
            self._deactivate(tenant)

    def _activate(self, tenant: str) -> None:
        self._lowest_active.add(tenant)
        self._active_weight += self.weight(tenant)

    def _deactivate(self, tenant: str) -> None:
        self._lowest_active.discard(tenant)
        self._active_weight -= self.weight(tenant)
        if not len(self._lowest_active):
            self._active_weight = 0.0  # no drift from float sums
            self._idle_floor = max(self._idle_floor, self.counter(tenant))

    def others_active(self, tenant: str) -> int:
        """How many tenants besides `tenant` have a request waiting or running here (or had one within
        the grace), or run elsewhere."""
        self._expire()
        return len(self._lowest_active) - (tenant in self._lowest_active)

    def share(self, tenant: str, total: int) -> float:
        """`tenant`'s weighted share of `total` (sequences) among the active tenants, itself included."""
        self._expire()
        weight = self.weight(tenant)
        active = self._active_weight + (0.0 if tenant in self._lowest_active else weight)
        return total * weight / active

    def running(self, tenant: str, model: str) -> int:
        """The sequences of `model` the workers last said `tenant` runs (any coordinator's requests)."""
        models = self._running.get(tenant)
        return models[model] if models is not None else 0

    def ended(self, worker_id: str, tenant: str, prompt_tokens: int, generated_tokens: int) -> None:
        """One of our requests ended on that worker, with that usage: its next beat counts it too, and
        it is not service the others gave."""
        report = self._reports.get(worker_id)
        if report is not None:
            report.ours[(tenant, 0)] += prompt_tokens
            report.ours[(tenant, 1)] += generated_tokens

    def waiting(self, model: str) -> Iterable[str]:
        """The tenants some coordinator has requests of waiting for `model` (by the workers' last beats,
        which pass on what each coordinator answered them): at most MAX_HEARTBEAT_TENANTS."""
        return self._waiting.get(model, Counter()).keys()

    def beat(self, worker_id: str, model: str, tenants: Iterable[TenantUse], waiting: Iterable[str] = ()) -> None:
        """A worker's heartbeat: charge each tenant what the others' requests were served there since
        its last one, and take what each tenant runs there now, and who waits for its model."""
        report = self._reports.get(worker_id)
        served = {t.tenant: (t.prompt_tokens, t.generated_tokens) for t in tenants}
        running = {t.tenant: t.running for t in tenants if t.running}
        if report is not None:
            for tenant, (prompt, generated) in served.items():
                before = report.served.get(tenant, (0, 0))
                if prompt < before[0] or generated < before[1]:
                    before = (0, 0)  # the worker restarted: its counters began again
                others = (self._others(report, tenant, 0, prompt - before[0]),
                          self._others(report, tenant, 1, generated - before[1]))
                idle = any(others) and not self._is_active(tenant)
                if idle:
                    self._lift(tenant)  # it came back from idle at another coordinator, and was served there
                self.charge_prompt(tenant, others[0])
                self.charge_output(tenant, others[1])
                if idle and not len(self._lowest_active):  # and went idle again: as it left there
                    self._idle_floor = max(self._idle_floor, self.counter(tenant))
        else:
            report = self._reports[worker_id] = _WorkerReport(model, {}, {}, Counter())
        waits = frozenset(waiting)
        self._update_running(report.running, report.model, running, model)
        self._update_waiting(report.waiting, report.model, waits, model)
        report.model, report.served, report.running, report.waiting = model, served, running, waits

    def forget(self, worker_id: str) -> None:
        """The worker is gone: what it ran no longer counts."""
        report = self._reports.pop(worker_id, None)
        if report is not None:
            self._update_running(report.running, report.model, {}, report.model)
            self._update_waiting(report.waiting, report.model, frozenset(), report.model)

    @staticmethod
    def _others(report: _WorkerReport, tenant: str, kind: int, tokens: int) -> int:
        """Of `tokens` a worker served `tenant`, those not ours; ours not yet seen are kept for later."""
        ours = report.ours.pop((tenant, kind), 0)
        if ours > tokens:
            report.ours[(tenant, kind)] = ours - tokens
        return max(0, tokens - ours)

    def _update_waiting(self, old: frozenset[str], old_model: str, new: frozenset[str], new_model: str) -> None:
        for tenant in old:
            by_tenant = self._waiting[old_model]
            by_tenant[tenant] -= 1
            if by_tenant[tenant] <= 0:
                del by_tenant[tenant]
                if not by_tenant:
                    del self._waiting[old_model]
        for tenant in new:
            self._waiting.setdefault(new_model, Counter())[tenant] += 1

    def _update_running(self, old: Mapping[str, int], old_model: str, new: Mapping[str, int], new_model: str) -> None:
        """One worker's report of what runs there, replaced; a tenant that starts running somewhere
        becomes active here, and one that runs nowhere any more idle (unless it is active here)."""
        for tenant in set(old) | set(new):
            was = tenant in self._running
            models = self._running.setdefault(tenant, Counter())
            models[old_model] -= old.get(tenant, 0)
            models[new_model] += new.get(tenant, 0)
            for model in [m for m, n in models.items() if n <= 0]:
                del models[model]
            local = tenant in self._active or tenant in self._lingering
            if models and not was and not local:
                self._lift(tenant)  # back from idle at another coordinator: lifted there too
                self._activate(tenant)
            elif not models:
                del self._running[tenant]
                if was and not local:
                    self._deactivate(tenant)

    def charge_prompt(self, tenant: str, tokens: int) -> None:
        self._charge(tenant, self.prompt_weight * tokens)

    def charge_output(self, tenant: str, tokens: int = 1) -> None:
        self._charge(tenant, self.output_weight * tokens)

    def _charge(self, tenant: str, cost: float) -> None:
        if cost > 0:
            self._counters[tenant] = self._counters.get(tenant, 0.0) + cost / self.weight(tenant)
