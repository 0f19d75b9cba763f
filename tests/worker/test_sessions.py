import pytest

from worker.errors import WorkerError
from worker.sessions import KvLimits, SessionTable, common_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(capacity: int = 100, session_max: int = 50, sessions: int = 3, ttl: float = 10.0,  # type: ignore[no-untyped-def]
          unified: bool = False):
    clock = Clock()
    limits = KvLimits(capacity_tokens=capacity, session_max_tokens=session_max, max_sessions=sessions,
                      bytes_per_token=10)
    return SessionTable(limits, clock, ttl=ttl, kv_unified=unified), clock


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


def test_sequence_ids_are_handed_out_lowest_first_so_batches_stay_contiguous() -> None:
    t, _ = table(sessions=4)
    a, b, c = (t.admit(None, 1).session for _ in range(3))
    assert [a.seq_id, b.seq_id, c.seq_id] == [0, 1, 2]
    t.release(b, keep_kv=False)
    t.release(a, keep_kv=False)
    assert t.admit(None, 1).session.seq_id == 0
    assert t.admit(None, 1).session.seq_id == 1


def test_released_without_retaining_the_cells_must_be_freed() -> None:
    t, _ = table()
    s = t.admit(None, 10).session
    s.tokens.extend([1, 2, 3])
    assert t.release(s, keep_kv=False) == s.seq_id


# -- the prefix cache: what a new prompt reuses, and cells counted once ---------------------------------

SYSTEM = list(range(100, 115))  # a 15-token "system prompt" two requests share


def test_common_prefix() -> None:
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    for cut in range(0, 300, 7):
        a = list(range(300))
        b = a[:cut] + [-1] + a[cut + 1:]
        assert common_prefix(a, b) == cut


def test_a_new_request_takes_the_lowest_free_id_and_keeps_the_prefix_its_cells_hold() -> None:
    t, _ = table(sessions=4)
    first, second = t.admit(None, 10).session, t.admit(None, 10).session
    first.tokens.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    second.tokens.extend([1, 2, 50, 60])
    assert t.release(first, keep_kv=False, retain_cells=True) is None  # nothing to free: cells kept
    assert t.release(second, keep_kv=False, retain_cells=True) is None
    assert t.stats() == (0, 0, 0) and t.cells().cached == 14  # kept cells are free capacity, not use
    again = t.admit(None, 12, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert (again.session.seq_id, again.cached_tokens) == (0, 10)
    assert again.session.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    other = t.admit(None, 12, [1, 2, 99, 98, 97])  # seq 1 is the lowest free id: cut to what it shares
    assert (other.session.seq_id, other.session.tokens, other.cached_tokens) == (1, [1, 2], 2)
    assert t.stats() == (2, 12, 24) and t.cells().cached == 0
    repeat = t.admit(None, 5, [7, 7])
    assert repeat.session.seq_id == 2 and repeat.cached_tokens == 0


def test_the_last_prompt_token_is_never_reused_it_must_be_decoded_for_logits() -> None:
    t, _ = table()
    s = t.admit(None, 10).session
    s.tokens.extend([1, 2, 3])
    t.release(s, keep_kv=False, retain_cells=True)
    assert t.admit(None, 10, [1, 2, 3]).cached_tokens == 2


def test_adopt_takes_the_longest_prefix_any_other_sequence_holds_when_worth_it() -> None:
    t, _ = table(capacity=300, sessions=4)
    holders = [t.admit(None, 40).session for _ in range(3)]
    holders[0].tokens.extend(SYSTEM[:5])
    holders[1].tokens.extend(SYSTEM + [1, 2])
    holders[2].tokens.extend([9, 9, 9])
    for s in holders[1:]:
        t.release(s, keep_kv=False, retain_cells=True)  # ids 1 and 2 free, holding their leftovers
    prompt = SYSTEM + [7, 8]
    new = t.admit(None, 30, prompt)
    assert (new.session.seq_id, new.cached_tokens) == (1, 15)  # the lowest free id: its own cells serve
    t.release(new.session, keep_kv=False, retain_cells=True)
    other = t.admit(None, 30, [9, 9, 9, 9])  # takes id 1 (lowest), cut to nothing it shares
    assert other.session.seq_id == 1 and other.cached_tokens == 0
    assert t.adopt(other.session, [9, 9, 9, 9], min_gain=4) is None  # seq 2 holds 3: below the minimum
    assert t.adopt(other.session, [9, 9, 9, 9], min_gain=3) == 2
    assert other.session.tokens == [9, 9, 9]
    late = t.admit(None, 30, prompt)  # id 2 (lowest free) holds [9, 9, 9]: nothing of this prompt
    assert late.session.seq_id == 2 and late.cached_tokens == 0
    assert t.adopt(late.session, prompt, min_gain=1) == 0  # busy seq 0 holds SYSTEM[:5]: the longest now
    assert late.session.tokens == SYSTEM[:5]
    # split KV: a copy is the session's own cells, nothing is shared
    assert t.cells().shared == 0 and t.stats()[1] == 5 + 3 + 5


def test_shared_cells_count_once_and_outlive_the_sequence_that_wrote_them() -> None:
    t, _ = table(capacity=100, sessions=4, unified=True)
    a = t.admit(None, 30, SYSTEM + [1]).session
    a.tokens.extend(SYSTEM + [1, 2, 3, 4, 5])  # prefilled and generating: 20 cells
    prompt = SYSTEM + [6, 6]
    b = t.admit(None, 30, prompt).session
    assert t.adopt(b, prompt) == a.seq_id and b.tokens == SYSTEM
    assert t.stats() == (2, 20, 20 + 10 + 15)  # A's 20 cells; B may add 15 past the 15 it shares
    assert t.cells().shared == 15
    b.tokens.extend([6, 6, 42])  # B prefills its own part and generates
    assert t.stats()[1] == 23 and t.cells().shared == 15
    c = t.admit(None, 30, SYSTEM + [6, 6, 42, 0]).session
    assert t.adopt(c, SYSTEM + [6, 6, 42, 0]) == b.seq_id  # 15 cells written by A, 3 by B
    assert t.stats()[1] == 23 and t.cells().shared == 18
    # A ends: llama.cpp frees only the cells no other sequence is on, so must we
    assert t.release(a, keep_kv=False) == a.seq_id
    assert t.stats()[1] == 18 and t.cells().shared == 18
    assert t.release(b, keep_kv=False) == b.seq_id
    assert t.stats() == (1, 18, 30) and t.cells().shared == 0


def test_a_unified_cache_gives_up_cached_cells_for_room_but_not_shared_ones() -> None:
    t, _ = table(capacity=100, session_max=60, sessions=4, unified=True)
    a = t.admit(None, 60, SYSTEM + [1]).session
    a.tokens.extend(SYSTEM + list(range(45)))  # 60 cells
    t.release(a, keep_kv=False, retain_cells=True)
    assert t.stats() == (0, 0, 0) and t.cells().cached == 60
    b = t.admit(None, 30, SYSTEM + [2])
    assert b.session.seq_id == 1 and b.freed_seq_ids == ()  # an empty sequence before a cached one
    assert t.adopt(b.session, SYSTEM + [2]) == a.seq_id
    assert t.cells().cached == 45 and t.stats()[1] == 15
    # 15 + 15 (B) + 45 cached + 50 > 100: the cache goes, its shared cells stay with B
    c = t.admit(None, 50, [5])
    assert c.freed_seq_ids == (a.seq_id,) and c.session.seq_id == 2
    assert t.cells().cached == 0 and t.stats() == (2, 15, 15 + 15 + 50)


def test_a_split_cache_keeps_cached_cells_they_take_room_from_nobody() -> None:
    t, _ = table(capacity=100, session_max=60, sessions=4)
    a = t.admit(None, 60).session
    a.tokens.extend(range(60))
    t.release(a, keep_kv=False, retain_cells=True)
    b = t.admit(None, 60, [5])
    assert b.freed_seq_ids == () and b.session.seq_id == 0 and t.cells().cached == 0  # cut: lowest id
    c = t.admit(None, 40, [5])
    assert c.freed_seq_ids == () and t.stats() == (2, 0, 100)


def test_unified_takes_an_empty_sequence_then_the_one_cached_longest_ago() -> None:
    t, _ = table(sessions=3, unified=True)
    ss = [t.admit(None, 10).session for _ in range(3)]
    for s in (ss[2], ss[0]):
        s.tokens.extend([s.seq_id])
        t.release(s, keep_kv=False, retain_cells=True)
    assert t.release(ss[1], keep_kv=False) == 1  # freed, empty
    assert t.admit(None, 5, [8, 8]).session.seq_id == 1
    assert t.admit(None, 5, [8, 8]).session.seq_id == 2  # cached before seq 0
    assert t.admit(None, 5, [8, 8]).session.seq_id == 0


def test_a_refused_admission_evicts_nothing() -> None:
    t, _ = table(capacity=100, session_max=60, sessions=3)
    kept = t.admit("old", 30).session
    kept.tokens.extend(range(30))
    t.release(kept, keep_kv=True)
    t.admit(None, 60)
    with pytest.raises(WorkerError) as refused:
        t.admit(None, 50, [1, 2])  # 60 + 50 > 100 even without "old": evicting it would not help
    assert refused.value.reason == "kv_full"
    assert t.lookup("old") is kept and t.evicted_total == 0 and t.stats() == (2, 30, 90)


def test_abandoning_an_admission_gives_a_kept_session_its_cells_back() -> None:
    t, _ = table()
    a = t.admit("chat", 20).session
    a.tokens.extend(range(12))
    t.release(a, keep_kv=True)
    again = t.admit("chat", 30, [0, 1, 2, 99])
    assert again.session is a and a.tokens == [0, 1, 2] and again.cached_tokens == 3
    assert t.abandon(again) is None
    assert a.tokens == list(range(12)) and not a.busy and t.stats() == (1, 12, 12)
    new = t.admit(None, 10, [5])
    assert t.abandon(new) == new.session.seq_id and t.stats() == (1, 12, 12)
