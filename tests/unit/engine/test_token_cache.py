"""The tokenisation cache: a hit needs the same text and gives back the bytes kept for it, and the cache holds
at most its byte budget, dropping the least recently used texts first."""

from __future__ import annotations

import pytest

from kvmesh.engine.token_cache import FrequencySketch, TokenCache, entry_bytes

pytestmark = pytest.mark.unit


def test_a_repeated_text_hits_and_a_different_one_misses() -> None:
    cache = TokenCache(2**20)
    assert cache.get("hello world") is None
    cache.put("hello world", b"\x05\x06\x07")
    assert cache.get("hello world") == b"\x05\x06\x07"
    assert cache.get("hello world!") is None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.entries) == (1, 2, 1)
    assert cache.get("hello world", scope="other tenant") is None
    cache.put("hello world", b"\x09", scope="other tenant")
    assert cache.get("hello world", scope="other tenant") == b"\x09" and cache.get("hello world") == b"\x05\x06\x07"


def test_putting_a_text_again_keeps_the_first_entry() -> None:
    cache = TokenCache(2**20)
    cache.put("t", b"first")
    cache.put("t", b"second")
    assert cache.get("t") == b"first"
    assert cache.stats.entries == 1 and cache.stats.bytes == entry_bytes("t", b"first")


def test_the_least_recently_used_text_goes_first_and_the_budget_holds() -> None:
    texts = [f"text {i} " * 20 for i in range(4)]
    ids = bytes(range(40))
    one = entry_bytes(texts[0], ids)
    cache = TokenCache(3 * one + one // 2)  # room for three entries
    for t in texts[:3]:
        cache.put(t, ids)
    assert cache.get(texts[0]) == ids  # texts[1] is now the least recently used
    assert cache.get(texts[3]) is None and cache.get(texts[3]) is None  # asked for twice: more than texts[1]
    cache.put(texts[3], ids)
    assert cache.get(texts[1]) is None
    assert all(cache.get(t) == ids for t in (texts[0], texts[2], texts[3]))
    assert cache.stats.evictions == 1
    assert cache.stats.entries == 3
    assert cache.stats.bytes == 3 * one <= cache.max_bytes


def test_a_full_cache_admits_only_a_text_asked_for_more_often_than_what_it_displaces() -> None:
    texts = [f"text {i} " * 20 for i in range(3)]
    ids = bytes(range(40))
    one = entry_bytes(texts[0], ids)
    cache = TokenCache(2 * one + one // 2)  # room for two
    for t in texts[:2]:
        assert cache.get(t) is None
        cache.put(t, ids)
    assert cache.get(texts[2]) is None  # once, as often as texts[0] (the least recently used)
    cache.put(texts[2], ids)
    assert cache.get(texts[2]) is None and cache.stats.rejections == 1  # not admitted; now asked for 3 times
    cache.put(texts[2], ids)
    assert cache.get(texts[2]) == ids and cache.get(texts[0]) is None  # in, displacing texts[0] (asked once)
    assert (cache.stats.evictions, cache.stats.entries, cache.stats.rejections) == (1, 2, 1)


def test_a_cycle_slightly_larger_than_the_budget_still_hits() -> None:
    """Plain LRU hits never here (each text is evicted just before it comes back); admission keeps most."""
    texts = [f"prompt {i:02d} " * 30 for i in range(64)]  # all the same size
    ids = bytes(100)
    cache = TokenCache(52 * entry_bytes(texts[0], ids))
    for _ in range(5):
        for t in texts:
            if cache.get(t) is None:
                cache.put(t, ids)
    hits_last_round = sum(cache.get(t) is not None for t in texts)
    assert hits_last_round == 52 and cache.stats.entries == 52
    assert cache.stats.bytes <= cache.max_bytes


def test_the_sketch_counts_forgets_by_halving_and_checks_its_width() -> None:
    sk = FrequencySketch(width=64)
    for _ in range(5):
        sk.add(hash("a"))
    assert sk.estimate(hash("a")) >= 5 and sk.estimate(hash("never")) <= 5
    for _ in range(40):
        sk.add(hash("a"))
    assert sk.estimate(hash("a")) == FrequencySketch.MAX_COUNT  # saturates
    for i in range(10 * 64):  # one sample period of other lookups: every count halved at least once
        sk.add(hash(f"other {i}"))
    assert sk.estimate(hash("a")) < FrequencySketch.MAX_COUNT
    for bad in (0, 3, 1 << 17):
        with pytest.raises(ValueError, match="width"):
            FrequencySketch(width=bad)


def test_off_or_too_large_keeps_nothing() -> None:
    off = TokenCache(0)
    off.put("t", b"\x01")
    assert off.get("t") is None and off.stats.bytes == 0
    small = TokenCache(100)
    small.put("x" * 1000, b"\x01\x02")
    assert small.get("x" * 1000) is None and small.stats.entries == 0
    with pytest.raises(ValueError, match="max_bytes"):
        TokenCache(-1)
