"""The approximate prefix index: chained block hashes, per-worker match shares, bounds."""

from __future__ import annotations

from coordinator.affinity.prefixes import PrefixIndex, block_hashes, request_text
from protocol.worker import GenerateRequest

SYSTEM = "You are the keeper of a lighthouse. " * 20  # 720 characters: 2 whole blocks of 256


def req(text: str) -> GenerateRequest:
    return GenerateRequest(prompt=text)


def test_equal_hashes_mean_equal_prefixes_and_a_partial_block_is_not_indexed() -> None:
    a = block_hashes("m", SYSTEM + "Q1", 256, 100)
    b = block_hashes("m", SYSTEM + "Q2 is longer", 256, 100)
    assert len(a) == 2 and a == b  # both end inside the third block
    c = block_hashes("m", "x" + SYSTEM, 256, 100)
    assert c[0] != a[0] and c[1] != a[1]  # a change early on changes every later hash
    assert block_hashes("other", SYSTEM, 256, 100)[0] != a[0]  # per model
    assert block_hashes("m", SYSTEM, 256, 100, tenant="k:1")[0] != a[0]  # per tenant
    assert block_hashes("m", SYSTEM, 256, 100, tenant="k:1") != block_hashes("m", SYSTEM, 256, 100, tenant="k:2")
    assert len(block_hashes("m", SYSTEM * 10, 256, 5)) == 5  # bounded work per request


def test_match_gives_each_worker_the_share_of_the_prefix_it_was_sent() -> None:
    index = PrefixIndex(block_chars=256, capacity=1000)
    long = SYSTEM * 2 + "question"  # 5 whole blocks
    index.record(index.hashes("m", req(SYSTEM)), "w1")  # the first 2 blocks
    index.record(index.hashes("m", req(long)), "w2")  # all 5
    assert index.match(index.hashes("m", req(long))) == {"w1": 0.4, "w2": 1.0}
    assert index.match(index.hashes("m", req("different " * 100))) == {}


def test_messages_index_like_their_rendered_conversation() -> None:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    turn1 = GenerateRequest.model_validate({"messages": first})
    turn2 = GenerateRequest.model_validate({"messages": [*first, {"role": "assistant", "content": "Hello"},
                                                         {"role": "user", "content": "More"}]})
    assert request_text(turn2).startswith(request_text(turn1))
    index = PrefixIndex(block_chars=64, capacity=1000)
    index.record(index.hashes("m", turn1), "w1")
    assert index.match(index.hashes("m", turn2))["w1"] > 0.8


def test_the_index_is_bounded_and_forgets_a_worker_that_left() -> None:
    index = PrefixIndex(block_chars=16, capacity=10)
    index.record(index.hashes("m", req("a" * 16 * 30)), "w1")
    assert len(index) == 10
    index.record(index.hashes("m", req("b" * 64)), "w2")
    index.forget_worker("w2")
    assert index.match(index.hashes("m", req("b" * 64))) == {}
    assert PrefixIndex(block_chars=16, capacity=0).hashes("m", req("a" * 64)) == []  # off


def test_heartbeats_make_the_index_the_workers_truth() -> None:
    index = PrefixIndex(block_chars=256, capacity=1000)
    long = index.hashes("m", req(SYSTEM * 2 + "question"))  # 5 blocks
    short = index.hashes("m", req(SYSTEM))  # its first 2
    # Another coordinator sent the long prompt to w2: this one learns it from w2's heartbeat.
    index.report("w2", [h.hex() for h in long])
    assert index.match(long) == {"w2": 1.0}
    # w1 was sent the short one from here; its heartbeat does not list it yet: the record stands.
    index.record(short, "w1")
    index.report("w1", [])
    assert index.match(long) == {"w1": 0.4, "w2": 1.0}
    # w2 evicted the long prompt but for its first 2 blocks (another prompt's cells kept them).
    index.report("w2", [h.hex() for h in short])
    assert index.match(long) == {"w1": 0.4, "w2": 0.4}
    index.report("w2", [])
    assert index.match(long) == {"w1": 0.4}
    index.forget_worker("w1")
    index.report("w1", [])
    assert index.match(long) == {}


def test_a_reported_block_the_lru_dropped_comes_back_with_the_next_heartbeat() -> None:
    index = PrefixIndex(block_chars=16, capacity=4)
    held = index.hashes("m", req("a" * 16 * 4))
    index.report("w1", [h.hex() for h in held])
    index.record(index.hashes("m", req("b" * 16 * 4)), "w2")  # pushes w1's blocks out of the index
    assert index.match(held) == {}
    index.report("w1", [h.hex() for h in held])
    assert index.match(held) == {"w1": 1.0} and len(index) == 4
    assert PrefixIndex(block_chars=16, capacity=0).report("w1", [h.hex() for h in held]) is None  # off
