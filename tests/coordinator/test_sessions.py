from __future__ import annotations

from coordinator.sessions import SessionTable


def test_remember_forget_and_worker_removal() -> None:
    table = SessionTable(capacity=10)
    table.remember("s1", "a")
    table.remember("s2", "a")
    table.remember("s3", "b")
    assert table.worker_of("s1") == "a"
    table.forget_worker("a")
    assert (table.worker_of("s1"), table.worker_of("s2"), table.worker_of("s3")) == (None, None, "b")
    table.forget("s3")
    assert len(table) == 0


def test_least_recently_used_is_evicted_first() -> None:
    table = SessionTable(capacity=2)
    table.remember("s1", "a")
    table.remember("s2", "a")
    table.remember("s1", "a")  # used again: now the most recent
    table.remember("s3", "b")
    assert (table.worker_of("s1"), table.worker_of("s2"), table.worker_of("s3")) == ("a", None, "b")


def test_moving_a_session_reindexes_it() -> None:
    table = SessionTable(capacity=5)
    table.remember("s1", "a")
    table.remember("s1", "b")
    table.forget_worker("a")
    assert table.worker_of("s1") == "b"
