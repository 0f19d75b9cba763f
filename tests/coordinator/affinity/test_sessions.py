from __future__ import annotations

from coordinator.affinity.sessions import SessionTable


def test_remember_move_and_forget() -> None:
    table = SessionTable(capacity=10)
    table.remember("s1", "a")
    table.remember("s2", "a")
    table.remember("s1", "b")
    assert (table.worker_of("s1"), table.worker_of("s2"), table.worker_of("s3")) == ("b", "a", None)
    table.forget("s1")
    table.forget("never")
    assert len(table) == 1


def test_least_recently_used_is_evicted_first() -> None:
    table = SessionTable(capacity=2)
    table.remember("s1", "a")
    table.remember("s2", "a")
    table.remember("s1", "a")  # used again: now the most recent
    table.remember("s3", "b")
    assert (table.worker_of("s1"), table.worker_of("s2"), table.worker_of("s3")) == ("a", None, "b")


def test_a_new_id_is_claimed_once_until_given_back() -> None:
    table = SessionTable(capacity=4)
    assert table.claim("s") and not table.claim("s")
    table.unclaim("s")
    assert table.claim("s")
