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


def test_the_workers_heartbeats_say_where_a_session_is_before_this_table_does() -> None:
    """Several coordinators: the worker that lists a session in its heartbeat holds it, whichever
    coordinator placed or moved it; the table answers only for one no heartbeat lists yet."""
    from protocol.health import session_digest

    listed: dict[str, str] = {}
    table = SessionTable(capacity=10, held_by=listed.get)
    assert table.worker_of(("", "s1")) is None
    table.remember(("", "s1"), "w1")
    assert table.worker_of(("", "s1")) == "w1"  # not in any heartbeat yet: this table's own placement
    listed[session_digest("", "s1")] = "w2"  # another coordinator moved it to w2
    assert table.worker_of(("", "s1")) == "w2"
    listed.clear()  # the worker stopped listing it: the table remembers where it last was
    assert table.worker_of(("", "s1")) == "w2"
    listed[session_digest("acme", "s1")] = "w3"  # the same id in another tenant is another session
    assert table.worker_of(("", "s1")) == "w2" and table.worker_of(("acme", "s1")) == "w3"
