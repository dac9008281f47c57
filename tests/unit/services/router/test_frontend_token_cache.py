"""The router's frontend tokenises a repeated prompt text once (`--tokenize-cache-mb`): the second request
gets the same ids from the cache without calling the tokenizer; a negative budget is refused by name."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.security.client_keys import ClientKeys
from kvmesh.services.router.auth import RateLimiter
from kvmesh.services.router.frontend import Frontend
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.tokenize import RouterTokenizer

pytestmark = pytest.mark.unit


def _frontend(cache_mb: int) -> tuple[Frontend, list[str]]:
    tok = RouterTokenizer("", cache_mb)
    encoded: list[str] = []
    plain = tok.encode

    def counting_encode(text: str) -> list[int]:
        encoded.append(text)
        return plain(text)

    tok.encode = counting_encode  # type: ignore[method-assign]
    core: Any = SimpleNamespace(limits=CoreLimits())
    return Frontend(core, tok, ClientKeys.load(""), RateLimiter(0, 1), "m"), encoded


@pytest.mark.parametrize("n_chars", [100, 10_000])  # inline and on a worker thread
def test_a_repeated_text_is_tokenised_once(n_chars: int) -> None:
    fe, encoded = _frontend(cache_mb=1)
    text = ("kv cache " * n_chars)[:n_chars]
    first = asyncio.run(fe.tokenize_text(text, "t1"))
    with pytest.raises(ValueError, match="read-only"):
        first.array[0] = 7  # kept by every attempt of the request: nobody changes it
    second = asyncio.run(fe.tokenize_text(text, "t1"))
    assert second.array.tolist() == fe.tokenizer.tok.encode(text) and len(second) > 1
    assert second.wire == first.wire  # the cached bytes are what a worker request splices in
    assert encoded == [text]
    assert (fe.tokenizer.cache.stats.hits, fe.tokenizer.cache.stats.misses) == (1, 1)


def test_cache_off_tokenises_every_time() -> None:
    fe, encoded = _frontend(cache_mb=0)
    for _ in range(2):
        asyncio.run(fe.tokenize_text("same text", "t1"))
    assert encoded == ["same text", "same text"]


def test_a_negative_budget_names_the_setting() -> None:
    with pytest.raises(InvalidArgument, match="tokenize_cache_mb"):
        RouterTokenizer("", -1)


def test_tenants_do_not_share_entries() -> None:
    """A text one tenant had tokenised is tokenised again for another (no timing tells who sent what)."""
    fe, encoded = _frontend(cache_mb=1)
    for tenant in ("t1", "t2", "t1"):
        asyncio.run(fe.tokenize_text("shared system prompt", tenant))
    assert encoded == ["shared system prompt"] * 2
    assert (fe.tokenizer.cache.stats.hits, fe.tokenizer.cache.stats.entries) == (1, 2)
