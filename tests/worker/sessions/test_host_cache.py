"""The prompt cache in host memory: the longest prefix of a tenant's own, bounded in bytes and entries."""

from worker.sessions.host_cache import MAX_ENTRIES, HostCache


def test_the_longest_prefix_of_the_tenants_own_entries_and_at_least_asked() -> None:
    cache = HostCache(1000)
    assert cache.put("A", [1, 2, 3, 4], b"x" * 10) and cache.put("A", [1, 2, 9], b"y" * 10)
    assert cache.put("B", [1, 2, 3, 4, 5, 6], b"z" * 10)
    found = cache.best("A", [1, 2, 3, 4, 5, 6], at_least=2)
    assert found is not None and found[0].cells == b"x" * 10 and found[1] == 4
    assert cache.best("A", [1, 2, 3, 4, 5, 6], at_least=5) is None  # B's longer one is not A's
    assert cache.best("C", [1, 2, 3], at_least=1) is None
    assert cache.best("A", [7, 2, 3], at_least=1) is None


def test_an_entry_a_longer_one_holds_is_dropped_for_it_and_a_shorter_one_is_not_kept() -> None:
    cache = HostCache(1000)
    cache.put("A", [1, 2], b"a" * 10)
    assert cache.put("A", [1, 2, 3], b"b" * 20)
    assert len(cache) == 1 and cache.bytes == 20
    assert not cache.put("A", [1, 2], b"c" * 10)  # the longer one holds it all
    assert cache.put("B", [1, 2], b"d" * 10) and len(cache) == 2  # another tenant's is its own


def test_bounded_least_recently_used_first() -> None:
    cache = HostCache(100)
    assert not cache.put("A", [1], b"x" * 26)  # over a quarter of the limit
    for i in range(5):
        assert cache.put("A", [i + 10], b"x" * 25)
    assert cache.bytes <= 100 and len(cache) == 4
    assert cache.best("A", [10], at_least=1) is None  # the first, least recently used, went
    assert cache.best("A", [11], at_least=1) is not None  # now the most recently used
    cache.put("A", [20], b"x" * 25)
    assert cache.best("A", [11], at_least=1) is not None and cache.best("A", [12], at_least=1) is None


def test_at_most_max_entries_and_off_at_zero() -> None:
    cache = HostCache(1 << 30)
    for i in range(MAX_ENTRIES + 3):
        cache.put("A", [i], b"x")
    assert len(cache) == MAX_ENTRIES
    off = HostCache(0)
    assert not off.takes(1) and not off.put("A", [1], b"x") and len(off) == 0
