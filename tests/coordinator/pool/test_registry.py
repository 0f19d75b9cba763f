"""Registry: states by heartbeat age, O(1) aggregates kept equal to a from-scratch sum, corrections."""

from __future__ import annotations

import random

from coordinator.pool.registry import ALIVE, MODELS_REMEMBERED, RELEASE_LAG, STALE, Correction, Registry
from tests.coordinator.fakes import heartbeat


def fresh(removed: list[str] | None = None) -> Registry:
    return Registry(stale_after=3.0, dead_after=6.0,
                    on_removed=(lambda w: removed.append(w.worker_id)) if removed is not None else None)


def recomputed(reg: Registry, model: str | None = None) -> tuple[int, int, int, int, int]:
    """From every record the registry still holds, not from its own alive index, which could keep a
    worker it no longer knows."""
    alive = [w for w in reg.all() if w.state == ALIVE and model in (None, w.model)]
    return (len(alive), sum(max(0, w.max_sessions - w.sessions) for w in alive),
            sum(w.max_sessions for w in alive),
            sum(max(0, w.kv_capacity_bytes - w.kv_reserved_bytes) for w in alive),
            sum(w.kv_capacity_bytes for w in alive))


def summed(reg: Registry, model: str | None = None) -> tuple[int, int, int, int, int]:
    t = reg.totals(model)
    if t is None:
        return (0, 0, 0, 0, 0)
    return (t.workers, t.free_sessions, t.max_sessions, t.free_kv_bytes, t.kv_capacity_bytes)


def test_upsert_then_update_keeps_one_record() -> None:
    reg = fresh()
    reg.upsert(heartbeat("a", timestamp=1, sessions=1), now=0.0)
    reg.upsert(heartbeat("a", timestamp=2, sessions=3), now=1.0)
    assert reg.alive_count == 1
    assert reg.get("a").sessions == 3  # type: ignore[union-attr]
    assert summed(reg) == (1, 1, 4, 1_000_000, 1_000_000)


def test_alive_stale_dead_by_heartbeat_age() -> None:
    removed: list[str] = []
    reg = fresh(removed)
    reg.upsert(heartbeat("a", timestamp=1), now=0.0)
    reg.upsert(heartbeat("b", timestamp=1), now=2.0)
    reg.sweep(2.99)
    assert (reg.get("a").state, reg.get("b").state) == (ALIVE, ALIVE)  # type: ignore[union-attr]
    reg.sweep(3.0)
    assert reg.get("a").state == STALE  # type: ignore[union-attr]
    assert summed(reg) == recomputed(reg) and reg.totals(None).workers == 1  # type: ignore[union-attr]
    reg.sweep(6.0)
    assert removed == ["a"] and reg.get("a") is None
    assert reg.get("b").state == STALE  # type: ignore[union-attr]
    reg.upsert(heartbeat("b", timestamp=9), now=7.0)  # a stale worker that heartbeats again is back
    assert reg.get("b").state == ALIVE and reg.alive_count == 1  # type: ignore[union-attr]


def test_model_known_while_stale_and_forgotten_when_removed() -> None:
    reg = fresh()
    reg.upsert(heartbeat("a", timestamp=1, model="x"), now=0.0)
    reg.sweep(4.0)
    assert reg.totals("x") is None and reg.knows_model("x")
    reg.sweep(7.0)
    assert not reg.knows_model("x")


def test_aggregates_match_recomputation_under_random_changes() -> None:
    rng = random.Random(7)
    reg = fresh()
    now = 0.0
    for step in range(2_000):
        now += rng.random() * 0.1
        action = rng.random()
        wid = f"w{rng.randrange(12)}"
        rec = reg.get(wid)
        keys = list(rec.corrections) if rec is not None else []
        if action < 0.45:
            listed = rng.sample(keys, k=rng.randrange(min(len(keys), 4) + 1))
            reg.upsert(heartbeat(wid, timestamp=now + rng.uniform(-1, 1), model=rng.choice(["x", "y"]),
                                 sessions=rng.randrange(len(listed), 5), streams=listed,
                                 kv_reserved_bytes=rng.randrange(1_200_000)), now=now)
        elif action < 0.65:
            reg.correct(wid, step, Correction(rng.randrange(0, 200_000), rng.choice([0, 1])))
        elif action < 0.8 and keys:
            kept = rng.choice([None, rng.randrange(50_000)])
            reg.end(wid, rng.choice(keys), now + rng.uniform(-1, 1), kept_kv_bytes=kept)
        elif action < 0.85:
            reg.remove(wid)  # alive, stale or unknown: an operator's removal, not a sweep's
        else:
            reg.sweep(now)
        for model in (None, "x", "y"):
            assert summed(reg, model) == recomputed(reg, model), step
            assert {w.worker_id for w in reg.alive(model)} == {
                w.worker_id for w in reg.all() if w.state == ALIVE and model in (None, w.model)}, step
        assert reg.alive_count == sum(w.state == ALIVE for w in reg.all()), step
        for w in reg.all():
            expect = [sum(c.effect(k in w.listed)[i] for k, c in w.corrections.items()) for i in (0, 1)]
            assert [w.extra_kv_bytes, w.extra_sessions] == expect, step


def test_a_running_stream_counts_while_the_workers_report_does_not_list_it() -> None:
    reg = fresh()
    reg.upsert(heartbeat("a", timestamp=100.0), now=0.0)
    reg.correct("a", 7, Correction(50_000, 1))  # reserved: not on the worker yet
    assert (reg.get("a").sessions, reg.get("a").kv_reserved_bytes) == (1, 50_000)  # type: ignore[union-attr]
    reg.upsert(heartbeat("a", timestamp=101.0), now=1.0)  # made before the worker admitted it
    assert reg.get("a").sessions == 1  # type: ignore[union-attr]
    reg.upsert(heartbeat("a", timestamp=101.5, sessions=1, kv_reserved_bytes=40_000, streams=[7]), now=1.5)
    assert (reg.get("a").sessions, reg.get("a").kv_reserved_bytes) == (1, 40_000)  # type: ignore[union-attr]
    # The worker finished it; the coordinator has not read its end yet: still counted, once.
    reg.upsert(heartbeat("a", timestamp=102.0), now=2.0)
    assert (reg.get("a").sessions, reg.get("a").kv_reserved_bytes) == (1, 50_000)  # type: ignore[union-attr]
    reg.end("a", 7, 102.1)
    assert (reg.get("a").sessions, reg.get("a").kv_reserved_bytes) == (0, 0)  # type: ignore[union-attr]


def test_an_ended_stream_is_taken_off_every_report_that_still_lists_it() -> None:
    """Churn (issue 11): a heartbeat that counts a stream which has ended since (the worker frees a
    cancelled stream's sequence at its next step, and a heartbeat may be in flight) no longer holds a
    phantom session until the next one."""
    reg = fresh()
    reg.upsert(heartbeat("a", timestamp=100.0, sessions=1, kv_reserved_bytes=10_000, streams=[7]), now=0.0)
    reg.correct("a", 7, Correction(10_000, 1))
    assert reg.get("a").sessions == 1  # type: ignore[union-attr]
    reg.end("a", 7, 100.2)
    assert (reg.get("a").sessions, reg.get("a").kv_reserved_bytes) == (0, 0)  # type: ignore[union-attr]
    # Made after the end, before the worker freed it: still listed, still taken off.
    reg.upsert(heartbeat("a", timestamp=100.3, sessions=1, kv_reserved_bytes=10_000, streams=[7]), now=0.3)
    assert reg.get("a").sessions == 0 and 7 in reg.get("a").corrections  # type: ignore[union-attr]
    # Not listed, but made within RELEASE_LAG of the end: kept in case it turns up yet.
    reg.upsert(heartbeat("a", timestamp=100.4), now=0.4)
    assert reg.get("a").sessions == 0 and 7 in reg.get("a").corrections  # type: ignore[union-attr]
    reg.upsert(heartbeat("a", timestamp=100.2 + RELEASE_LAG), now=1.0)
    assert reg.get("a").sessions == 0 and reg.get("a").corrections == {}  # type: ignore[union-attr]


def test_a_stream_the_worker_keeps_listing_is_believed_after_a_few_heartbeats() -> None:
    reg = fresh()
    reg.upsert(heartbeat("a", timestamp=100.0, sessions=1, streams=[7]), now=0.0)
    reg.correct("a", 7, Correction(10, 1))
    reg.end("a", 7, 100.0)
    for beat in range(1, 4):
        assert reg.get("a").sessions == 0  # type: ignore[union-attr]
        reg.upsert(heartbeat("a", timestamp=100.0 + beat, sessions=1, streams=[7]), now=float(beat))
    assert reg.get("a").sessions == 1 and reg.get("a").corrections == {}  # type: ignore[union-attr]


def test_corrections_on_stale_worker_leave_aggregates_alone() -> None:
    reg = fresh()
    reg.upsert(heartbeat("a", timestamp=1), now=0.0)
    reg.sweep(4.0)
    reg.correct("a", 1, Correction(10_000, 1))
    assert summed(reg) == (0, 0, 0, 0, 0)
    reg.end("a", 1, 2.0)
    reg.upsert(heartbeat("a", timestamp=3), now=5.0)
    assert summed(reg) == recomputed(reg) == (1, 4, 4, 1_000_000, 1_000_000)


def test_names_resolve_to_models_and_aliases_follow_their_workers() -> None:
    beat = heartbeat
    reg = Registry(stale_after=3, dead_after=6)
    reg.upsert(beat("w1", timestamp=0, model="smol", aliases=("smollm2", "small")), 0)
    reg.upsert(beat("w2", timestamp=0, model="gemma", aliases=("small",)), 0)
    reg.upsert(beat("w3", timestamp=0, model="gemma"), 0)
    assert (reg.resolve("smol"), reg.resolve("smollm2"), reg.resolve("nope")) == ("smol", "smol", None)
    assert reg.resolve("small") == "gemma"  # shared: the model with more workers behind the name
    assert reg.aliases_of("smol") == ["small", "smollm2"] and reg.known_models() == ["gemma", "smol"]
    reg.upsert(beat("w1", timestamp=0, model="smol", aliases=()), 1)  # aliases changed
    assert reg.resolve("smollm2") is None
    reg.remove("w1")
    assert reg.resolve("smol") == "smol" and not reg.knows_model("smol")  # gone, still not "unknown"
    for i in range(MODELS_REMEMBERED):
        reg.upsert(beat(f"x{i}", timestamp=0, model=f"m{i}"), 2)
        reg.remove(f"x{i}")
    assert reg.resolve("smol") is None  # the memory of gone models is bounded


def test_the_sessions_each_worker_lists_are_found_by_digest_until_it_stops_listing_them() -> None:
    from protocol.health import session_digest

    one, two = session_digest("", "one"), session_digest("t", "two")
    reg = fresh()
    reg.upsert(heartbeat("a", timestamp=1, sessions=2, held=[one, two]), now=0.0)
    assert reg.holder(one) == "a" and reg.holder(two) == "a"
    # Moved: b lists it before a stops listing it; a's next report does not take it from b.
    reg.upsert(heartbeat("b", timestamp=1, sessions=1, held=[two]), now=0.5)
    assert reg.holder(two) == "b"
    reg.upsert(heartbeat("a", timestamp=2, sessions=1, held=[one]), now=1.0)
    assert reg.holder(two) == "b" and reg.holder(one) == "a"
    reg.upsert(heartbeat("a", timestamp=3, sessions=0), now=1.5)  # ended
    assert reg.holder(one) is None
    reg.remove("b")
    assert reg.holder(two) is None

def test_a_lost_worker_is_stale_at_once_holds_no_session_and_is_removed_in_heartbeat_order() -> None:
    from protocol.health import session_digest

    removed: list[str] = []
    reg = fresh(removed)
    one = session_digest("", "one")
    reg.upsert(heartbeat("early", timestamp=1), now=0.0)
    reg.upsert(heartbeat("a", timestamp=1, sessions=1, held=[one]), now=1.0)
    reg.upsert(heartbeat("b", timestamp=1), now=1.5)
    reg.lost("a", now=2.0)  # it left, or refused a connection: 1 s after its beat, not 3
    assert reg.get("a").state == STALE and reg.alive_count == 2  # type: ignore[union-attr]
    assert reg.holder(one) is None and summed(reg) == recomputed(reg)
    reg.lost("a", now=2.1)  # twice is once
    reg.lost("nobody", now=2.1)
    # Removed dead_after - stale_after after it was lost, and the stale list keeps heartbeat order:
    # "early" (stale by its age at 3.0) goes first, and "a" is not held up behind it, nor it behind "a".
    reg.sweep(3.0)
    assert reg.get("early").state == STALE  # type: ignore[union-attr]
    reg.sweep(4.99)
    assert removed == []
    reg.sweep(5.0)
    assert removed == ["a"]
    reg.sweep(6.0)
    assert removed == ["a", "early"]
    reg.upsert(heartbeat("b", timestamp=2), now=6.0)
    reg.lost("b", now=6.5)
    reg.upsert(heartbeat("b", timestamp=3, sessions=1, held=[one]), now=7.0)  # a heartbeat brings it back
    assert reg.get("b").state == ALIVE and reg.holder(one) == "b"  # type: ignore[union-attr]


def test_a_worker_other_coordinators_use_that_refused_as_full_counts_so_until_its_next_heartbeat() -> None:
    """What another coordinator's streams take from a worker shows here first as its refusal."""
    reg = fresh()
    # Each report lists a stream this coordinator has no correction for: another coordinator's.
    reg.upsert(heartbeat("a", timestamp=1, sessions=1, streams=[900]), now=0.0)
    reg.upsert(heartbeat("b", timestamp=1, sessions=1, streams=[901]), now=0.0)
    assert summed(reg) == (2, 6, 8, 2_000_000, 2_000_000)
    reg.refused("a", "sessions_full", kv_bytes=10_000)
    a = reg.get("a")
    assert a is not None and a.sessions == a.max_sessions and a.idle_sessions == 0
    assert summed(reg) == recomputed(reg) == (2, 3, 8, 2_000_000, 2_000_000)
    # A KV refusal: less free than that request needed, so a smaller one may still go there.
    reg.refused("b", "kv_full", kv_bytes=300_000)
    b = reg.get("b")
    assert b is not None and b.kv_capacity_bytes - b.kv_reserved_bytes + b.idle_kv_bytes == 299_999
    assert summed(reg) == recomputed(reg) == (2, 3, 8, 1_299_999, 2_000_000)
    reg.refused("b", "kv_full", kv_bytes=500_000)  # a larger refusal says no more than the smaller one
    assert summed(reg)[3] == 1_299_999
    reg.refused("b", "unknown_session", kv_bytes=1)  # not a capacity refusal: changes nothing
    assert summed(reg)[3] == 1_299_999
    # Their next reports are the truth again.
    reg.upsert(heartbeat("a", timestamp=2, sessions=2, streams=[900, 902]), now=1.0)
    reg.upsert(heartbeat("b", timestamp=2, sessions=0), now=1.0)
    assert summed(reg) == recomputed(reg) == (2, 6, 8, 2_000_000, 2_000_000)


def test_a_refusal_from_a_worker_only_this_coordinator_uses_changes_nothing() -> None:
    """One coordinator: a refusal is a seam (a sequence still ending) that its corrections account
    for; marking the worker full would refuse requests it has room for (tests/faults/test_churn.py)."""
    reg = fresh()
    reg.upsert(heartbeat("a", timestamp=1, sessions=1, streams=[7]), now=0.0)
    reg.correct("a", 7, Correction(50_000, 1))  # the listed stream is this coordinator's own
    before = summed(reg)
    reg.refused("a", "sessions_full", kv_bytes=10_000)
    reg.refused("a", "kv_full", kv_bytes=10_000)
    assert summed(reg) == recomputed(reg) == before
    a = reg.get("a")
    assert a is not None and a.sessions == 1 and not a.sessions_refused and a.kv_free_below is None
