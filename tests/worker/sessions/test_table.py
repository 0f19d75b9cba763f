import random

import pytest

from worker.errors import WorkerError
from worker.sessions.table import KvLimits, SessionTable, shared_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(capacity: int = 100, session_max: int = 50, sessions: int = 3, ttl: float = 10.0):  # type: ignore[no-untyped-def]
    clock = Clock()
    limits = KvLimits(capacity_tokens=capacity, session_max_tokens=session_max, max_sessions=sessions,
                      bytes_per_token=10)
    return SessionTable(limits, clock, ttl=ttl), clock


def test_one_shot_reserves_and_frees() -> None:
    t, _ = table()
    admission = t.admit(None, 40)
    assert t.stats() == (1, 0, 40)
    assert t.release(admission.session, keep_kv=True) == admission.session.seq_id  # one-shot: always freed
    assert t.stats() == (0, 0, 0)


def test_kv_full_then_admits_again() -> None:
    t, _ = table(capacity=100)
    a = t.admit(None, 50)
    t.admit(None, 50)
    with pytest.raises(WorkerError) as refused:
        t.admit(None, 1)
    assert (refused.value.status, refused.value.reason) == (503, "kv_full")
    t.release(a.session, keep_kv=False)
    t.admit(None, 50)


def test_sessions_full() -> None:
    t, _ = table(sessions=2)
    t.admit(None, 1)
    t.admit(None, 1)
    with pytest.raises(WorkerError) as refused:
        t.admit(None, 1)
    assert refused.value.reason == "sessions_full"


def test_named_session_keeps_its_tokens_and_shrinks_to_them() -> None:
    t, _ = table()
    a = t.admit("chat", 40)
    a.session.tokens.extend(range(12))
    assert t.release(a.session, keep_kv=True) is None
    assert t.stats() == (1, 12, 12)
    again = t.admit("chat", 30)
    assert again.session is a.session and t.stats() == (1, 12, 30)


def test_busy_session_is_refused() -> None:
    t, _ = table()
    t.admit("chat", 10)
    with pytest.raises(WorkerError) as refused:
        t.admit("chat", 10)
    assert (refused.value.status, refused.value.reason) == (409, "session_busy")


def test_idle_sessions_expire_after_ttl_and_leave_a_tombstone() -> None:
    t, clock = table(ttl=10)
    a = t.admit("chat", 10)
    a.session.tokens.extend([1, 2, 3])
    t.release(a.session, keep_kv=True)
    clock.now += 9
    assert t.expire_idle() == []
    clock.now += 2
    assert t.expire_idle() == [a.session.seq_id]
    assert t.stats() == (0, 0, 0) and t.expired_total == 1
    with pytest.raises(WorkerError) as gone:
        t.lookup("chat")
    assert (gone.value.status, gone.value.reason) == (404, "session_expired")


def test_idle_session_is_evicted_for_room_least_recently_used_first() -> None:
    t, clock = table(capacity=100, sessions=3)
    first = t.admit("old", 40)
    first.session.tokens.extend(range(40))
    t.release(first.session, keep_kv=True)
    clock.now += 1
    second = t.admit("newer", 40)
    second.session.tokens.extend(range(40))
    t.release(second.session, keep_kv=True)
    admission = t.admit(None, 50)  # 80 held + 50 > 100: the older idle session goes
    assert admission.freed_seq_ids == (first.session.seq_id,)
    assert t.lookup("newer") is second.session
    assert t.evicted_total == 1


def test_delete_idle_session_allows_reuse_of_the_id() -> None:
    t, _ = table()
    a = t.admit("chat", 10)
    t.release(a.session, keep_kv=True)
    assert t.delete("chat") is a.session
    assert t.stats() == (0, 0, 0)
    assert t.lookup("chat") is None  # no tombstone: deleted on purpose
    with pytest.raises(WorkerError):
        t.delete("chat")


def test_session_deleted_while_busy_is_freed_at_release() -> None:
    t, _ = table()
    a = t.admit("chat", 10)
    t.delete("chat")
    assert t.release(a.session, keep_kv=True) == a.session.seq_id
    assert t.stats() == (0, 0, 0)


def test_sequence_ids_are_handed_out_next_to_running_ones_so_batches_stay_contiguous() -> None:
    """llama.cpp decodes only consecutive sequence ids in one forward pass: a new sequence goes next to a
    running one (the lowest such), never into a gap that would split the running ids further."""
    t, _ = table(sessions=8)
    a, b, c = (t.admit(None, 1).session for _ in range(3))
    assert [a.seq_id, b.seq_id, c.seq_id] == [0, 1, 2]
    t.release(b, keep_kv=False)
    t.release(a, keep_kv=False)
    assert t.admit(None, 1).session.seq_id == 1  # next to 2 (1 and 3 both are: the lower)
    assert t.admit(None, 1).session.seq_id == 0
    t2, _ = table(sessions=8)
    held = [t2.admit(None, 1).session for _ in range(6)]  # 0..5
    for session in held[1:5]:
        t2.release(session, keep_kv=False)  # running: 0 and 5
    assert t2.admit(None, 1).session.seq_id == 1  # beside 0, not 2 or 3, which would add a run
    assert t2.admit(None, 1).session.seq_id == 2  # 0-2 and 5 now: 2 and 4 both keep two runs
    # A leftover that matches the prompt but lies away from the running ids is not taken in place
    # (that split the running ids once every sequence had been used): the engine copies it instead.
    t3, _ = table(sessions=8)
    held = [t3.admit(None, 10).session for _ in range(6)]  # 0..5
    held[5].tokens.extend([9, 9, 9, 9, 9, 9])
    for session in held[1:5]:
        t3.release(session, keep_kv=False)
    t3.release(held[5], keep_kv=False, retain_cells=True)  # running: 0; seq 5 holds [9] * 6
    taken = t3.admit(None, 10, [9, 9, 9, 9, 9, 9, 1]).session
    assert taken.seq_id == 1 and taken.tokens == []
    assert t3.prefix_source([9, 9, 9, 9, 9, 9], tenant="", at_least=4, skip={1}) == (5, 6)


def test_a_fitting_free_sequence_holding_most_of_the_prompt_is_reused_else_an_empty_one() -> None:
    t, _ = table(sessions=5)
    first, second = t.admit(None, 10).session, t.admit(None, 10).session
    first.tokens.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    second.tokens.extend([1, 2, 50, 60])
    assert t.release(first, keep_kv=False, retain_cells=True) is None  # nothing to free: cells kept
    assert t.release(second, keep_kv=False, retain_cells=True) is None
    assert t.stats() == (0, 0, 0)  # kept cells are free capacity, not use
    # Nothing runs: any sequence fits, and seq 0's leftover holds most of this prompt.
    reused = t.admit(None, 12, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]).session
    assert reused.seq_id == first.seq_id and reused.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # Seq 0 runs: only seq 1 fits (beside it); it holds too little of this prompt, but taking any other
    # would split the running ids, so its leftover is what the engine trims.
    other = t.admit(None, 12, [1, 2, 99, 98, 97]).session
    assert other.seq_id == 1 and other.tokens == [1, 2, 50, 60]
    t.release(reused, keep_kv=False, retain_cells=True)  # seq 0 holds a leftover again; seq 1 runs
    # Seqs 0 and 2 fit beside 1: 0 holds a leftover this prompt does not match, 2 is empty: 2 it is.
    assert t.admit(None, 1, [7]).session.seq_id == 2


def test_released_without_retaining_the_cells_must_be_freed() -> None:
    t, _ = table()
    s = t.admit(None, 10).session
    s.tokens.extend([1, 2, 3])
    assert t.release(s, keep_kv=False) == s.seq_id


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([], [1, 2], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 9, 3], 1),
    ([5], [6], 0), (list(range(1000)), [*range(637), -1], 637), (list(range(1000)), list(range(999)), 999),
])
def test_shared_prefix(a: list[int], b: list[int], expected: int) -> None:
    assert shared_prefix(a, b) == shared_prefix(b, a) == expected


def test_prefix_source_is_the_longest_holder_past_the_minimum() -> None:
    t, _ = table(capacity=1000, session_max=200, sessions=4)
    running = t.admit(None, 100).session
    running.tokens = [7] * 80 + [1, 2]
    kept = t.admit("chat", 100).session
    kept.tokens = [7] * 90 + [3]
    freed = t.admit(None, 100).session
    freed.tokens = [7] * 95
    t.release(freed, keep_kv=False, retain_cells=True)  # a leftover
    prompt = [7] * 120
    assert t.prefix_source(prompt, tenant="", at_least=10, skip=set()) == (freed.seq_id, 95)
    assert t.prefix_source(prompt, tenant="", at_least=10, skip={freed.seq_id}) == (kept.seq_id, 90)
    assert t.prefix_source(prompt, tenant="", at_least=91, skip={freed.seq_id}) is None
    assert t.prefix_source([8] * 120, tenant="", at_least=1, skip=set()) is None
    assert t.prefix_source([7] * 5, tenant="", at_least=10, skip=set()) is None


# -- tenancy: ids, tombstones, the prompt cache and prefix copies are per tenant ----------------------


def test_the_same_id_names_a_separate_session_per_tenant() -> None:
    t, _ = table()
    a = t.admit("chat", 10, tenant="A").session
    assert a.tenant == "A"
    assert t.lookup("chat", tenant="B") is None  # A's session, busy or idle, is nothing to B
    b = t.admit("chat", 10, tenant="B").session  # not 409: A's being busy must not show
    assert b is not a and b.seq_id != a.seq_id and b.tenant == "B"
    t.release(a, keep_kv=True)
    t.release(b, keep_kv=True)
    assert t.lookup("chat", tenant="A") is a and t.lookup("chat", tenant="B") is b
    assert t.lookup("chat") is None  # the no-key tenant "" is a tenant like any other
    assert sorted((s.tenant, s.session_id) for s in t.describe()) == [("A", "chat"), ("B", "chat")]


def test_a_tombstone_answers_only_the_tenant_whose_session_expired() -> None:
    t, clock = table(ttl=10)
    a = t.admit("chat", 10, tenant="A").session
    t.release(a, keep_kv=True)
    clock.now += 11
    assert t.expire_idle() == [a.seq_id]
    assert t.lookup("chat", tenant="B") is None  # B never had it: no 404 session_expired
    with pytest.raises(WorkerError) as gone:
        t.lookup("chat", tenant="A")
    assert (gone.value.status, gone.value.reason) == (404, "session_expired")


@pytest.mark.parametrize(("deleter", "deleted"), [("A", "A"), ("B", "B"), ("C", None), ("", None)])
def test_delete_removes_only_the_tenants_own_session(deleter: str, deleted: str | None) -> None:
    t, _ = table()
    held = {}
    for tenant in ("A", "B"):
        held[tenant] = t.admit("chat", 10, tenant=tenant).session
        t.release(held[tenant], keep_kv=True)
    if deleted is None:
        with pytest.raises(WorkerError) as unknown:
            t.delete("chat", tenant=deleter)
        assert (unknown.value.status, unknown.value.reason) == (404, "unknown_session")
    else:
        assert t.delete("chat", tenant=deleter) is held[deleted]
    for tenant, session in held.items():
        assert t.lookup("chat", tenant=tenant) is (None if tenant == deleted else session)


PROMPT = list(range(1, 11))


@pytest.mark.parametrize(("taker", "reused"), [("A", True), ("B", False), ("", False)])
def test_a_leftover_is_reused_only_by_its_tenant(taker: str, reused: bool) -> None:
    t, _ = table(sessions=3)
    freed = t.admit(None, 12, PROMPT, tenant="A").session
    freed.tokens.extend(PROMPT)
    t.release(freed, keep_kv=False, retain_cells=True)
    taken = t.admit(None, 12, [*PROMPT, 11], tenant=taker).session
    # Another tenant gets the lowest EMPTY sequence, and A's cells stay for A.
    assert (taken.seq_id == freed.seq_id, taken.tokens) == ((True, PROMPT) if reused else (False, []))


def test_taking_another_tenants_leftover_reports_it_empty_so_the_engine_clears_it() -> None:
    t, _ = table(sessions=1)
    freed = t.admit(None, 12, PROMPT, tenant="A").session
    freed.tokens.extend(PROMPT)
    t.release(freed, keep_kv=False, retain_cells=True)
    taken = t.admit(None, 12, PROMPT, tenant="B").session  # the only free sequence holds A's cells
    assert taken.seq_id == freed.seq_id and taken.tokens == []  # cached 0: llama_memory_seq_rm(seq, 0, -1)
    t.release(taken, keep_kv=False, retain_cells=True)  # now B's leftover (its cells: B's own tokens)
    again = t.admit(None, 12, PROMPT, tenant="A").session
    assert again.tokens == []


def leftovers(t: SessionTable, clock: Clock, keeps: list[float], tenant: str = "A") -> list[int]:
    """Every sequence of `t` taken, then freed with its cells (each kept `keeps[i]` seconds); their ids."""
    sessions = [t.admit(None, 12, PROMPT, tenant=tenant, keep=keep).session for keep in keeps]
    for session in sessions:
        session.tokens.extend(PROMPT)
        clock.now += 1
        t.release(session, keep_kv=False, retain_cells=True)
    return [s.seq_id for s in sessions]


def test_a_kept_leftover_is_the_last_free_sequence_taken_and_its_tenant_still_reuses_it() -> None:
    t, clock = table(capacity=100, sessions=3)
    kept, plain, _ = leftovers(t, clock, [300.0, 0.0, 0.0])
    taken = [t.admit(None, 12, [50, 51], tenant="B").session for _ in range(2)]
    assert kept not in {s.seq_id for s in taken} and plain in {s.seq_id for s in taken}  # freed longest ago, yet kept
    reused = t.admit(None, 12, [*PROMPT, 11], tenant="A").session
    assert (reused.seq_id, reused.tokens) == (kept, PROMPT)  # its tenant's next prompt reads the kept cells


def test_when_every_free_sequence_is_kept_the_keep_that_ends_soonest_goes_and_a_keep_expires() -> None:
    t, clock = table(capacity=100, sessions=3)
    t.kept_per_tenant = 3
    first, second, _ = leftovers(t, clock, [300.0, 100.0, 200.0])
    assert t.admit(None, 12, [50], tenant="B").session.seq_id == second  # all kept: the soonest to end
    clock.now += 400  # the others' keeps are over: the one freed longest ago goes first again
    assert t.admit(None, 12, [50], tenant="B").session.seq_id == first


def test_a_tenant_keeps_at_most_its_bound_of_leftovers_and_a_named_session_keeps_nothing_more() -> None:
    t, clock = table(capacity=100, sessions=3)
    assert t.kept_per_tenant == 1  # a quarter of 3 sequences, at least 1
    first, _, _ = leftovers(t, clock, [300.0, 300.0, 0.0])  # the second keep ended the first's
    assert t.admit(None, 12, [50], tenant="B").session.seq_id == first
    named = t.admit("s", 12, PROMPT, tenant="C", keep=300.0).session
    assert named.keep == 0.0


def test_prefix_source_considers_only_the_tenants_sequences() -> None:
    t, _ = table(capacity=1000, session_max=200, sessions=4)
    running = t.admit(None, 100, tenant="A").session
    running.tokens = [7] * 80
    kept = t.admit("chat", 100, tenant="A").session
    kept.tokens = [7] * 90
    t.release(kept, keep_kv=True)
    freed = t.admit(None, 100, tenant="A").session
    freed.tokens = [7] * 95
    t.release(freed, keep_kv=False, retain_cells=True)
    prompt = [7] * 120
    assert t.prefix_source(prompt, tenant="A", at_least=10, skip=set()) == (freed.seq_id, 95)
    assert t.prefix_source(prompt, tenant="A", at_least=10, skip={freed.seq_id}) == (kept.seq_id, 90)
    assert t.prefix_source(prompt, tenant="A", at_least=10, skip={freed.seq_id, kept.seq_id}) == (running.seq_id, 80)
    for other in ("B", ""):
        assert t.prefix_source(prompt, tenant=other, at_least=1, skip=set()) is None
    mine = t.admit(None, 100, tenant="B").session
    mine.tokens = [7] * 30
    assert t.prefix_source(prompt, tenant="B", at_least=1, skip=set()) == (mine.seq_id, 30)


def test_no_operation_sequence_lets_a_tenant_reach_another_tenants_session_or_cells() -> None:
    """Random admits (kept and one-shot), deletes and lookups by two tenants over the same few ids and
    the same few prompts, on a table small enough to evict and reuse leftovers. A model of who holds
    what (and whose tokens each sequence's cells hold, as the engine would leave them) must agree
    with the table after every step, and no tenant may ever get another's session, cells or prefix."""
    rng = random.Random(20240611)
    t, clock = table(capacity=60, session_max=20, sessions=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 9, 9, 9], [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]]
    named: dict[tuple[str, str], object] = {}  # (tenant, id) -> its live Session
    tombstones: set[tuple[str, str]] = set()
    owner: dict[int, str] = {}  # seq id -> the tenant whose tokens its cells hold
    crossings = {"same_id": 0, "cells_cleared": 0, "tombstone_other": 0}

    def forget(freed: list[int] | tuple[int, ...], *, tombstone: bool) -> None:
        for seq_id in freed:
            owner.pop(seq_id, None)  # the engine frees these cells
            for key, session in list(named.items()):
                if session.seq_id == seq_id:  # type: ignore[attr-defined]
                    del named[key]
                    if tombstone:
                        tombstones.add(key)

    def run(session, prompt: list[int], tenant: str) -> None:  # type: ignore[no-untyped-def]
        """What the engine does with an admitted request: keep the cached prefix, prefill the rest."""
        assert session.tenant == tenant
        if session.tokens:
            assert owner.get(session.seq_id) == tenant, "handed another tenant's cells"
        elif owner.get(session.seq_id) not in (None, tenant):
            crossings["cells_cleared"] += 1
        source = t.prefix_source(prompt, tenant=tenant, at_least=1, skip={session.seq_id})
        if source is not None:
            assert owner.get(source[0]) == tenant, "offered another tenant's cells to copy"
        keep = shared_prefix(session.tokens, prompt)
        del session.tokens[keep:]
        session.tokens.extend(prompt[keep:])
        owner[session.seq_id] = tenant

    for _ in range(3000):
        tenant, sid = rng.choice("AB"), rng.choice(["s1", "s2", "s3"])
        op = rng.choice(["keep", "one_shot", "delete", "lookup"])
        key, other = (tenant, sid), ("B" if tenant == "A" else "A", sid)
        prompt = rng.choice(prompts)
        clock.now += 1
        if op in ("keep", "one_shot"):
            if op == "keep":
                assert t.lookup(sid, tenant=tenant, continuation=False) is named.get(key)  # as the gate does
                tombstones.discard(key)
                crossings["same_id"] += other in named
            try:
                admission = t.admit(sid if op == "keep" else None, len(prompt) + 4, prompt, tenant=tenant)
            except WorkerError as refused:
                assert refused.reason in ("kv_full", "sessions_full")
                continue
            forget(admission.freed_seq_ids, tombstone=True)
            session = admission.session
            if op == "keep" and key in named:
                assert session is named[key]
            else:
                assert session not in named.values()  # a new session, never another's
            run(session, prompt, tenant)
            if op == "keep":
                named[key] = session
                assert t.release(session, keep_kv=True) is None
            else:
                freed = t.release(session, keep_kv=False, retain_cells=rng.random() < 0.8)
                forget([freed] if freed is not None else [], tombstone=False)
        elif op == "delete":
            if key in named:
                session = named.pop(key)
                assert t.delete(sid, tenant=tenant) is session
                forget([session.seq_id], tombstone=False)  # type: ignore[attr-defined]
            else:
                with pytest.raises(WorkerError) as unknown:
                    t.delete(sid, tenant=tenant)
                assert unknown.value.reason == "unknown_session"
        else:
            continuation = rng.random() < 0.5
            crossings["tombstone_other"] += other in tombstones and key not in tombstones
            if key in tombstones and continuation:
                with pytest.raises(WorkerError) as expired:
                    t.lookup(sid, tenant=tenant, continuation=True)
                assert expired.value.reason == "session_expired"
            else:
                assert t.lookup(sid, tenant=tenant, continuation=continuation) is named.get(key)
                if not continuation:
                    tombstones.discard(key)
        for (held_tenant, held_id), session in named.items():
            assert t.lookup(held_id, tenant=held_tenant) is session
        assert sorted((s.tenant, s.session_id) for s in t.describe()) == sorted(named)
    # The run did reach the situations the property is about.
    assert min(crossings.values()) > 20, crossings


def test_a_cancelled_session_counts_as_ending_until_released_and_the_release_is_announced() -> None:
    t, _ = table(sessions=1)
    released: list[int] = []
    t.on_release = lambda: released.append(1)
    busy = t.admit(None, 10).session
    with pytest.raises(WorkerError) as full:
        t.admit(None, 10)
    assert full.value.reason == "sessions_full" and t.ending == 0
    t.mark_ending(busy)  # its client left: the engine releases it at its next step
    assert t.ending == 1
    t.release(busy, keep_kv=False)
    assert (t.ending, released) == (0, [1])
    t.mark_ending(busy)  # no longer busy: nothing to wait for
    assert t.ending == 0
    assert t.admit(None, 10).session.seq_id == busy.seq_id



def test_a_release_that_frees_a_sequence_of_a_full_table_is_announced_as_room() -> None:
    """`on_room` (several coordinators: a heartbeat at once): only when the table was full, and only when
    the sequence is really given up (a kept named session still holds it)."""
    t, _ = table(sessions=2)
    room: list[int] = []
    t.on_room = lambda: room.append(1)
    first = t.admit(None, 5).session
    t.release(first, keep_kv=False)
    assert room == []  # one of two was taken: the table was not full
    one, two = t.admit(None, 5).session, t.admit("chat", 5).session
    t.release(two, keep_kv=True)  # kept: the table is as full as before
    assert room == []
    t.release(one, keep_kv=False)
    assert room == [1]
    again = t.admit(None, 5).session
    t.abandon(again)  # an import that failed gives its sequence up too
    assert room == [1, 1]

# -- several choices: a group of one-shot sessions, all or none ---------------------------------------------


def test_choices_take_a_sequence_and_a_reservation_each_and_give_all_back() -> None:
    t, _ = table(capacity=200, session_max=50, sessions=4)
    admission = t.admit(None, 40, [1, 2, 3], choices=3, stream_ref=77)
    sessions = [admission.session, *admission.extra]
    assert len({s.seq_id for s in sessions}) == 3 and all(s.busy and s.session_id is None for s in sessions)
    assert t.stats() == (3, 0, 120)  # n x (prompt + max_tokens): each choice holds its own copy of the prompt
    assert t.load().stream_refs == (77,)  # one stream, listed once
    for session in sessions:
        t.release(session, keep_kv=True)  # one-shot: never kept
    assert t.stats() == (0, 0, 0) and t.load().stream_refs == ()


@pytest.mark.parametrize(("sessions", "capacity", "reason"), [(2, 200, "sessions_full"), (4, 100, "kv_full")])
def test_choices_are_admitted_all_or_none(sessions: int, capacity: int, reason: str) -> None:
    t, _ = table(capacity=capacity, session_max=50, sessions=sessions)
    with pytest.raises(WorkerError) as refused:
        t.admit(None, 40, choices=3)
    assert refused.value.reason == reason
    assert t.stats() == (0, 0, 0)
    assert len({t.admit(None, 1).session.seq_id for _ in range(sessions)}) == sessions  # no slot was lost


def test_choice_zero_takes_the_cached_prompt_and_the_others_start_empty() -> None:
    t, _ = table(capacity=200, session_max=50, sessions=4)
    first = t.admit(None, 20, [5, 6, 7, 8])
    first.session.tokens.extend([5, 6, 7, 8])
    t.release(first.session, keep_kv=False, retain_cells=True)
    again = t.admit(None, 20, [5, 6, 7, 8, 9], choices=3)
    assert again.session.seq_id == first.session.seq_id and again.session.tokens == [5, 6, 7, 8]
    assert all(s.tokens == [] and s.seq_id != first.session.seq_id for s in again.extra)


def test_choices_never_keep_a_session() -> None:
    t, _ = table()
    with pytest.raises(ValueError, match="one-shot"):
        t.admit("chat", 10, choices=2)


def test_a_claimed_session_is_neither_used_nor_evicted_and_comes_back_as_it_was() -> None:
    t, _ = table(capacity=100, session_max=50, sessions=2)
    kept = t.admit("a", 30, tenant="k").session
    kept.tokens = list(range(30))
    t.release(kept, keep_kv=True)
    with pytest.raises(WorkerError) as other:  # another tenant's id names nothing
        t.claim("a", tenant="j")
    assert other.value.status == 404
    claimed = t.claim("a", tenant="k")
    assert claimed is kept and claimed.busy
    with pytest.raises(WorkerError) as busy:
        t.claim("a", tenant="k")
    assert busy.value.status == 409
    # An admission that needs its room cannot evict it while claimed (it could an idle one).
    with pytest.raises(WorkerError) as full:
        t.admit(None, 50, tenant="k")
        t.admit(None, 50, tenant="k")
    assert full.value.status == 503
    t.release(claimed, keep_kv=True)
    assert not kept.busy and t.lookup("a", tenant="k") is kept and len(kept.tokens) == 30


def test_an_abandoned_import_leaves_no_trace() -> None:
    t, _ = table()
    before = t.stats()
    admission = t.admit("moved", 40, tenant="k")
    seq_id = t.abandon(admission.session)
    assert seq_id == admission.session.seq_id and t.stats() == before
    assert t.lookup("moved", tenant="k") is None  # no tombstone: the id is free, not expired
    assert t.admit("moved", 10, tenant="k").session.session_id == "moved"


def test_the_load_lists_every_named_session_held_and_a_new_one_is_announced_at_once() -> None:
    t, _ = table(sessions=3)
    announced: list[str] = []
    t.on_named = lambda: announced.append("new")
    kept = t.admit("chat-1", 10, tenant="acme")
    t.admit(None, 10)  # one-shot: no name to list
    assert announced == ["new"]
    t.release(kept.session, keep_kv=True)  # kept for a next turn: still held
    assert t.load().held == (("acme", "chat-1"),)
    t.admit("chat-1", 12, tenant="acme")  # its next turn: not new
    assert announced == ["new"]
    t.delete("chat-1", tenant="acme")
    assert t.load().held == ()


def test_heartbeats_list_the_prefix_blocks_the_cells_hold_most_recent_first_until_they_are_gone() -> None:
    t, clock = table(capacity=200, sessions=4)
    kept = t.admit("s1", 20, [1, 2, 3], prefix_blocks=("a1", "a2")).session
    kept.tokens = [1, 2, 3]
    t.release(kept, keep_kv=True)  # a kept session's cells hold its prompt
    clock.now += 1
    cached = t.admit(None, 20, [4, 5], prefix_blocks=("b1",)).session
    cached.tokens = [4, 5]
    t.release(cached, keep_kv=False, retain_cells=True)  # a leftover's cells too, for the next prompt
    clock.now += 1
    plain = t.admit(None, 20, [7], prefix_blocks=("a1", "c2")).session  # shares block a1 with s1
    assert t.load().prefixes == ("a1", "c2", "a2", "b1")  # running first, each block once
    t.release(plain, keep_kv=False)  # freed: its cells are cleared
    assert t.load().prefixes == ("a1", "a2", "b1")
    reuse = t.admit(None, 20, [4, 5, 6], prefix_blocks=("b1", "b2")).session  # takes the leftover's cells
    assert reuse.seq_id == cached.seq_id and t.load().prefixes == ("b1", "b2", "a1", "a2")
    t.delete("s1")
    assert t.load().prefixes == ("b1", "b2")
    assert t.admit(None, 10, [8]).session.prefix_blocks == ()  # a request sent without blocks names none


def test_the_listed_prefix_blocks_are_bounded() -> None:
    from protocol.health import MAX_HELD_PREFIX_BLOCKS

    t, _ = table(capacity=200, sessions=3)
    for i in range(3):
        t.admit(None, 10, [i], prefix_blocks=tuple(f"{i}-{j}" for j in range(MAX_HELD_PREFIX_BLOCKS)))
    assert len(t.load().prefixes) == MAX_HELD_PREFIX_BLOCKS


def test_a_load_counts_the_sequences_each_tenant_runs_now() -> None:
    t, _ = table(sessions=4)
    a1, a2 = t.admit(None, 10, tenant="t:a"), t.admit("chat", 10, tenant="t:a")
    t.admit(None, 10, tenant="t:b")
    assert t.load().running_by_tenant == {"t:a": 2, "t:b": 1}
    t.release(a1.session, keep_kv=False)
    t.release(a2.session, keep_kv=True)  # kept for a next turn: idle, not running
    assert t.load().running_by_tenant == {"t:b": 1}


def test_a_parked_session_gives_back_its_sequence_and_reservation_and_takes_them_again() -> None:
    t, _ = table(capacity=100, sessions=2)
    batch = t.admit(None, 40, stream_ref=7).session
    batch.tokens[:] = [1, 2, 3]
    t.admit(None, 30, stream_ref=8)
    released: list[int] = []
    t.on_release = lambda: released.append(1)
    freed = t.park(batch)
    assert freed == batch.seq_id and released  # the interactive request waiting in line is woken
    assert t.stats() == (1, 0, 30) and t.parked == 1
    load = t.load()
    assert load.sessions == 1 and load.parked == 1 and set(load.stream_refs) == {7, 8}  # a parked stream is listed
    interactive = t.admit(None, 50).session  # takes the parked one's sequence
    assert interactive.seq_id == freed
    assert t.unpark(batch) is None and t.parked == 1  # no sequence free: it stays parked
    t.release(interactive, keep_kv=False)
    assert t.unpark(batch) == () and t.parked == 0
    assert t.stats() == (2, 3, 70) and batch.tokens == [1, 2, 3] and batch.busy


def test_a_batch_admission_leaves_room_for_the_parked_but_an_interactive_one_does_not() -> None:
    t, _ = table(capacity=100, sessions=2)
    batch = t.admit(None, 40).session
    t.admit(None, 30)
    t.park(batch)
    with pytest.raises(WorkerError) as refused:
        t.admit(None, 10, yields=True)  # a newer batch request: the parked one resumes first
    assert refused.value.reason == "sessions_full"
    t.admit(None, 10)


def test_unparking_evicts_an_idle_kept_session_only_when_that_makes_room() -> None:
    t, _ = table(capacity=100, sessions=3)
    batch = t.admit(None, 50).session
    kept = t.admit("chat", 30).session
    kept.tokens[:] = list(range(30))
    t.release(kept, keep_kv=True)  # idle, holding 30 tokens and a sequence
    t.park(batch)
    t.admit(None, 50)
    blocker = t.admit(None, 20).session  # 100 reserved: even without the kept session, no room for 50
    assert t.unpark(batch) is None and t.lookup("chat") is kept  # nothing evicted for nothing
    t.release(blocker, keep_kv=False)
    assert t.unpark(batch) == (kept.seq_id,) and t.lookup("chat", continuation=False) is None


def test_a_parked_session_dropped_holds_nothing() -> None:
    t, _ = table(capacity=100, sessions=2)
    batch = t.admit(None, 40, stream_ref=3).session
    t.park(batch)
    t.mark_ending(batch)
    t.drop_parked(batch)
    assert t.parked == 0 and t.ending == 0 and t.stats() == (0, 0, 0) and t.load().stream_refs == ()
    t.admit(None, 50, yields=True)
    t.admit(None, 50, yields=True)


def test_only_a_running_one_shot_session_is_parked() -> None:
    t, _ = table()
    named = t.admit("chat", 10).session
    with pytest.raises(ValueError):
        t.park(named)
    one_shot = t.admit(None, 10).session
    t.release(one_shot, keep_kv=False)
    with pytest.raises(ValueError):
        t.park(one_shot)


def test_a_taken_interactive_leftover_is_displaced_for_the_engine_to_save_a_batch_one_is_not() -> None:
    t, _ = table(sessions=1)
    freed = t.admit(None, 12, PROMPT, tenant="A").session
    freed.tokens.extend(PROMPT)
    t.release(freed, keep_kv=False, retain_cells=True)
    taken = t.admit(None, 12, [20, 21], tenant="B", yields=True).session  # a batch request takes it
    assert taken.displaced == ("A", PROMPT) and taken.batch
    taken.tokens.extend([20, 21])
    t.release(taken, keep_kv=False, retain_cells=True)  # the batch request's leftover
    after = t.admit(None, 12, [30], tenant="A").session
    assert after.displaced is None and not after.batch
