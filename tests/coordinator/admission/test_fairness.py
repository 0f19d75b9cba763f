"""Fair shares on their own: the counters' charges and weights, the lift on return from idle, the
lowest-counter heap, and (as properties over random arrivals, with the real queue) the service gap
between backlogged tenants staying within the VTC paper's bound."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.admission.fairness import FairShares, Lowest
from coordinator.admission.queue import AdmissionQueue, Waiter

# -- the counters ---------------------------------------------------------------------------------------


def test_a_prompt_token_counts_once_a_generated_one_twice_divided_by_the_weight() -> None:
    fair = FairShares(weights={"t:heavy": 1.0, "t:light": 4.0})
    for tenant in ("t:heavy", "t:light"):
        fair.arrive(tenant)
    for tenant in ("t:heavy", "t:light"):
        fair.charge_prompt(tenant, 10)
        fair.charge_output(tenant, 5)
    assert fair.counter("t:heavy") == 20.0 and fair.counter("t:light") == 5.0
    assert fair.counter("t:nobody") == 0.0 and fair.weight("t:nobody") == 1.0


def test_a_tenant_returning_from_idle_is_lifted_to_the_lowest_active_counter() -> None:
    fair = FairShares()
    for tenant in ("a", "b"):
        fair.arrive(tenant)
    fair.charge_output("a", 50)  # 100
    fair.charge_output("b", 20)  # 40
    fair.arrive("c")  # never served: it would otherwise go before both until it had used 40
    assert fair.counter("c") == 40.0
    fair.depart("c")
    fair.charge_output("b", 100)  # 240: a (100) is now the lowest active
    fair.arrive("c")
    assert fair.counter("c") == 100.0


def test_a_tenant_still_active_is_not_lifted_and_a_lift_never_lowers() -> None:
    fair = FairShares()
    fair.arrive("a")
    fair.arrive("b")
    fair.charge_output("b", 30)  # 60
    fair.arrive("a")  # a second request of an active tenant: no lift
    assert fair.counter("a") == 0.0
    fair.charge_output("a", 100)  # 200, above b's 60
    fair.depart("a")
    fair.depart("a")
    fair.arrive("a")
    assert fair.counter("a") == 200.0


def test_when_no_one_is_active_the_last_one_s_counter_is_the_floor() -> None:
    fair = FairShares()
    fair.arrive("a")
    fair.charge_output("a", 500)  # 1000
    fair.depart("a")
    fair.arrive("b")  # arrives after a left: it does not get 1000 tokens' head start on a's return
    assert fair.counter("b") == 1000.0
    assert fair.others_active("a") == 1 and fair.others_active("b") == 0  # b is, a is not


def test_lowest_finds_the_lowest_counter_as_counters_grow_and_ties_go_to_the_first_added() -> None:
    counters = {"a": 0.0, "b": 0.0, "c": 5.0}
    lowest = Lowest(counters.__getitem__)
    for name in ("a", "b", "c"):
        lowest.add(name)
    assert lowest.lowest() == "a"
    counters["a"] = 10.0
    assert lowest.lowest() == "b"
    counters["b"] = 7.0
    assert lowest.lowest() == "c"
    lowest.discard("c")
    assert lowest.lowest() == "b" and "c" not in lowest and len(lowest) == 2
    lowest.discard("a")
    lowest.discard("b")
    assert lowest.lowest() is None


def test_lowest_stays_small_however_often_members_come_and_go() -> None:
    counters = {"stay": 0.0, "churn": 1.0}
    lowest = Lowest(counters.__getitem__)
    lowest.add("stay")
    for _ in range(10_000):
        lowest.add("churn")
        lowest.discard("churn")
    assert len(lowest._heap) <= 16  # stale entries are dropped, not kept for ever


# -- the queue in fair order --------------------------------------------------------------------------

pytestmark = pytest.mark.anyio


async def test_the_tenant_with_the_lowest_counter_goes_next_not_the_first_to_arrive() -> None:
    fair = FairShares()
    queue = AdmissionQueue(size=8, timeout=5, retry_after=1, fair=fair)
    for tenant in ("heavy", "light"):
        fair.arrive(tenant)
    fair.charge_output("heavy", 100)
    heavy = [queue.join("m", "heavy") for _ in range(3)]
    light = queue.join("m", "light")
    assert queue.is_head(light)
    queue.wake("m")
    assert light.future.done() and not any(w.future.done() for w in heavy)
    queue.leave(light)  # admitted: the turn passes to heavy, the only one left waiting
    assert heavy[0].future.done() and queue.waiting("m") == 3


async def test_without_fair_shares_the_queue_is_one_line_in_arrival_order() -> None:
    fair = FairShares()
    queue = AdmissionQueue(size=8, timeout=5, retry_after=1, fair=None)
    fair.charge_output("heavy", 100)
    first, light = queue.join("m", "heavy"), queue.join("m", "light")
    assert queue.is_head(first) and not queue.is_head(light)


async def test_each_tenant_has_its_own_bound_in_the_queue() -> None:
    queue = AdmissionQueue(size=2, timeout=5, retry_after=1, fair=FairShares())
    queue.join("m", "heavy")
    queue.join("m", "heavy")
    with pytest.raises(Exception, match="of this key's tenant already wait") as full:
        queue.join("m", "heavy")
    assert getattr(full.value, "reason", None) == "queue_full"
    queue.join("m", "light")  # the heavy tenant's full line does not refuse anyone else
    assert queue.waiting("m") == 3


# -- properties over random arrivals ----------------------------------------------------------------


@dataclass
class Job:
    tenant: str
    prompt: int
    output: int
    left: int = 0


def simulate(fair: FairShares, arrivals: list[Job], *, slots: int, rounds: int, fair_order: bool) -> list[float]:
    """A pool of `slots` sequences fed from the real queue: each round every running job makes one
    token (charged as it goes), finished jobs free their slot, and each free slot takes the queue's
    head (its prompt charged at admission). Both tenants stay backlogged (their jobs all wait from the
    start). Returns, after every round, the gap between the two tenants' weighted service."""
    return asyncio.run(_simulate(fair, arrivals, slots=slots, rounds=rounds, fair_order=fair_order))


async def _simulate(fair: FairShares, arrivals: list[Job], *, slots: int, rounds: int, fair_order: bool) -> list[float]:
    if True:  # the queue's waiters are futures of the running loop
        queue = AdmissionQueue(size=len(arrivals), timeout=60, retry_after=1, fair=fair if fair_order else None)
        waiting: dict[int, Job] = {}
        order: list[Waiter] = []
        for job in arrivals:
            fair.arrive(job.tenant)
            waiter = queue.join("m", job.tenant)
            waiting[id(waiter)] = job
            order.append(waiter)
        served = {"a": 0.0, "b": 0.0}
        running: list[Job] = []
        gaps = []
        for _ in range(rounds):
            for job in running:
                job.left -= 1
                cost = fair.output_weight
                fair.charge_output(job.tenant)
                served[job.tenant] += cost / fair.weight(job.tenant)
            for job in [j for j in running if j.left <= 0]:
                running.remove(job)
                fair.depart(job.tenant)
            while len(running) < slots and queue.length:
                head = next(w for w in order if w.queued and queue.is_head(w))
                queue.leave(head)
                job = waiting.pop(id(head))
                job.left = job.output
                fair.charge_prompt(job.tenant, job.prompt)
                served[job.tenant] += fair.prompt_weight * job.prompt / fair.weight(job.tenant)
                running.append(job)
            if not any(j.tenant == "a" for j in waiting.values()) or not any(j.tenant == "b" for j in waiting.values()):
                break  # one tenant is no longer backlogged: the bound is about backlogged tenants
            gaps.append(abs(served["a"] - served["b"]))
        return gaps


MAX_PROMPT, MAX_OUTPUT, SLOTS = 64, 32, 4


def workload(seed: int, heavy_first: int) -> list[Job]:
    """`heavy_first` of tenant a's jobs arrive before any of b's; then they alternate."""
    rng = random.Random(seed)
    jobs = [Job("a", rng.randint(1, MAX_PROMPT), rng.randint(1, MAX_OUTPUT)) for _ in range(heavy_first)]
    for _ in range(60):
        jobs.append(Job("b", rng.randint(1, MAX_PROMPT), rng.randint(1, MAX_OUTPUT)))
        jobs.append(Job("a", rng.randint(1, MAX_PROMPT), rng.randint(1, MAX_OUTPUT)))
    return jobs


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), heavy_first=st.integers(0, 80), weight_b=st.sampled_from([1.0, 3.0]))
def test_the_service_gap_between_backlogged_tenants_stays_within_the_vtc_bound(
        seed: int, heavy_first: int, weight_b: float) -> None:
    """Sheng et al., Theorem 4.4: for two backlogged clients the weighted service differs by at most
    2 x max(w_p x L_input, w_q x M), M the tokens the running batch can hold (here: what the slots'
    jobs can still generate before one of them frees its slot)."""
    fair = FairShares(weights={"a": 1.0, "b": weight_b})
    bound = 2 * max(fair.prompt_weight * MAX_PROMPT, fair.output_weight * SLOTS * MAX_OUTPUT)
    gaps = simulate(fair, workload(seed, heavy_first), slots=SLOTS, rounds=400, fair_order=True)
    assert gaps and max(gaps) <= bound, (max(gaps), bound)


def test_first_come_first_served_breaks_the_bound_when_one_tenant_arrives_first() -> None:
    """What the bound is worth: the same workload in arrival order leaves b unserved while a's
    earlier jobs run."""
    fair = FairShares()
    bound = 2 * max(fair.prompt_weight * MAX_PROMPT, fair.output_weight * SLOTS * MAX_OUTPUT)
    gaps = simulate(fair, workload(7, 40), slots=SLOTS, rounds=400, fair_order=False)
    assert max(gaps) > 2 * bound, (max(gaps), bound)


# -- several coordinators: what the workers report ----------------------------------------------------------


def use(tenant: str, running: int = 0, prompt: int = 0, generated: int = 0):  # type: ignore[no-untyped-def]
    from protocol.health import TenantUse

    return TenantUse(tenant=tenant, running=running, prompt_tokens=prompt, generated_tokens=generated)


def test_what_the_others_requests_were_served_is_charged_and_ours_is_not_twice() -> None:
    fair = FairShares()
    fair.beat("w1", "m", [use("a", prompt=100, generated=50)])  # the first beat: a baseline, nothing charged
    assert fair.counter("a") == 0
    fair.charge_prompt("a", 10)  # one of ours: charged as it ran (10 + 2 x 5)
    fair.charge_output("a", 5)
    fair.ended("w1", "a", 10, 5)
    fair.beat("w1", "m", [use("a", prompt=100 + 10 + 30, generated=50 + 5 + 20)])  # and the others': 30, 20
    assert fair.counter("a") == 20 + 30 + 2 * 20


def test_our_request_reported_after_its_beat_is_kept_for_the_next() -> None:
    fair = FairShares()
    fair.beat("w1", "m", [use("a")])
    fair.ended("w1", "a", 10, 0)  # ours ended, but the worker's beat did not count it yet
    fair.beat("w1", "m", [use("a", prompt=4)])  # 4 of the others'? No: 4 of our 10, the rest to come
    assert fair.counter("a") == 0
    fair.beat("w1", "m", [use("a", prompt=4 + 6 + 7)])  # our other 6, then 7 of the others'
    assert fair.counter("a") == 7


def test_a_restarted_workers_counters_start_again() -> None:
    fair = FairShares()
    fair.beat("w1", "m", [use("a", prompt=1000)])
    fair.beat("w1", "m", [use("a", prompt=40)])  # lower: the worker restarted, and served 40 since
    assert fair.counter("a") == 40


def test_a_tenant_running_elsewhere_is_active_here_and_holds_what_it_runs() -> None:
    fair = FairShares()
    fair.arrive("light")
    assert fair.others_active("light") == 0
    fair.beat("w1", "m", [use("heavy", running=3)])  # another coordinator's requests
    fair.beat("w2", "m", [use("heavy", running=2)])
    assert fair.others_active("light") == 1 and fair.running("heavy", "m") == 5
    assert fair.share("light", 10) == 5.0
    fair.charge_output("heavy", 40)
    fair.arrive("newcomer")  # lifted to the lowest active counter: light's 0, not heavy's 80
    assert fair.counter("newcomer") == 0
    fair.beat("w1", "m", [use("heavy")])
    assert fair.running("heavy", "m") == 2 and fair.others_active("light") == 2  # heavy (w2), newcomer
    fair.forget("w2")
    assert fair.running("heavy", "m") == 0 and fair.others_active("light") == 1


def test_a_tenant_active_nowhere_but_elsewhere_returns_lifted() -> None:
    fair = FairShares()
    fair.beat("w1", "m", [use("heavy", running=4)])
    fair.charge_output("heavy", 50)
    fair.arrive("light")  # heavy runs on another coordinator's behalf: light starts level with it
    assert fair.counter("light") == 100


def test_a_tenant_back_from_idle_at_another_coordinator_is_lifted_here_too() -> None:
    """Where it arrived it was lifted to the lowest active counter; here it must be too, or the two
    coordinators' counters for it would differ by that lift for ever."""
    fair = FairShares()
    fair.beat("w1", "m", [use("heavy"), use("light")])
    fair.arrive("heavy")
    fair.charge_output("heavy", 50)  # 100
    fair.beat("w1", "m", [use("heavy"), use("light", prompt=10)])  # light served elsewhere, not running now
    assert fair.counter("light") == 100 + 10


def test_a_tenant_served_only_elsewhere_sets_the_floor_as_it_did_there() -> None:
    """At the coordinator it went through, its departure made its counter the floor for the next one
    back from idle; here, where it was never seen running, its service does the same."""
    fair = FairShares()
    fair.beat("w1", "m", [use("heavy")])
    fair.beat("w1", "m", [use("heavy", prompt=60, generated=20)])  # 100, while no one is active here
    fair.arrive("light")
    assert fair.counter("light") == 100


def test_a_tenant_stays_active_for_the_grace_after_its_last_request_ends() -> None:
    now = [0.0]
    fair = FairShares(idle_grace=1.0, now=lambda: now[0])
    fair.arrive("heavy")
    fair.arrive("light")
    fair.depart("light")  # a closed-loop client between two requests
    now[0] = 0.5
    assert fair.others_active("heavy") == 1  # still kept in mind: headroom stays for its next request
    fair.charge_output("heavy", 100)
    fair.arrive("light")  # back within the grace: not lifted
    assert fair.counter("light") == 0
    fair.depart("light")
    now[0] = 1.6
    assert fair.others_active("heavy") == 0
    fair.arrive("light")  # back after it: lifted as any tenant back from idle
    assert fair.counter("light") == 200
