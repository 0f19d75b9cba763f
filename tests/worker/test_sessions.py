import pytest

from worker.errors import WorkerError
from worker.sessions import KvLimits, SessionTable, shared_prefix


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


def test_sequence_ids_are_handed_out_lowest_first_so_batches_stay_contiguous() -> None:
    t, _ = table(sessions=4)
    a, b, c = (t.admit(None, 1).session for _ in range(3))
    assert [a.seq_id, b.seq_id, c.seq_id] == [0, 1, 2]
    t.release(b, keep_kv=False)
    t.release(a, keep_kv=False)
    assert t.admit(None, 1).session.seq_id == 0
    assert t.admit(None, 1).session.seq_id == 1


def test_a_free_sequence_holding_most_of_the_prompt_is_reused_else_the_lowest_empty_one() -> None:
    t, _ = table(sessions=4)
    first, second = t.admit(None, 10).session, t.admit(None, 10).session
    first.tokens.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    second.tokens.extend([1, 2, 50, 60])
    assert t.release(first, keep_kv=False, retain_cells=True) is None  # nothing to free: cells kept
    assert t.release(second, keep_kv=False, retain_cells=True) is None
    assert t.stats() == (0, 0, 0)  # kept cells are free capacity, not use
    reused = t.admit(None, 12, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]).session
    assert reused.seq_id == first.seq_id and reused.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    other = t.admit(None, 12, [1, 2, 99, 98, 97]).session  # shares too little: the lowest EMPTY id,
    assert other.seq_id == 2 and other.tokens == []  # so seq 1's cells stay for a prompt they match
    assert t.admit(None, 1, [5]).session.seq_id == 3
    # Every free sequence holds a leftover now (only seq 1): it is the one freed longest ago.
    last = t.admit(None, 1, [7]).session
    assert last.seq_id == 1 and last.tokens == [1, 2, 50, 60]  # its cells' content, to be trimmed


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
    assert t.prefix_source(prompt, at_least=10, skip=set()) == (freed.seq_id, 95)
    assert t.prefix_source(prompt, at_least=10, skip={freed.seq_id}) == (kept.seq_id, 90)
    assert t.prefix_source(prompt, at_least=91, skip={freed.seq_id}) is None
    assert t.prefix_source([8] * 120, at_least=1, skip=set()) is None
    assert t.prefix_source([7] * 5, at_least=10, skip=set()) is None
