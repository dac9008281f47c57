"""`HfTokenizer.encode` takes `encode_batch` (GIL released) for long texts and `encode` for short ones: both
paths must give exactly the ids of the plain `tokenizers` call, at the boundary and well past it."""

from __future__ import annotations

import random
import threading

import pytest

from kvmesh.engine import tokenizer as tk_mod
from kvmesh.engine.tokenizer import HfTokenizer
from kvmesh.modelfiles import resolve_model_dir

pytestmark = pytest.mark.unit

MODEL = resolve_model_dir("")


@pytest.fixture(scope="module")
def tok() -> HfTokenizer:
    if MODEL is None:
        pytest.fail("the tiny model is missing: scripts/bootstrap.sh builds it")
    return HfTokenizer(MODEL)


def _text(n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["kv", "cache", "router", "token", "prefix", "the", "of", "zone", "é", "日本", "\n", "  "]
    out: list[str] = []
    while sum(map(len, out)) < n_chars:
        out.append(rng.choice(words) + str(rng.randrange(1000)))
    return " ".join(out)[:n_chars]


@pytest.mark.parametrize("n_chars", [1, tk_mod._GIL_FREE_CHARS - 1, tk_mod._GIL_FREE_CHARS, 50_000])
def test_both_paths_give_the_plain_ids(tok: HfTokenizer, n_chars: int) -> None:
    text = _text(n_chars, n_chars)
    assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids


def test_long_texts_encode_concurrently_with_correct_results(tok: HfTokenizer) -> None:
    texts = [_text(30_000, s) for s in range(4)]
    expected = [tok._tok.encode(t, add_special_tokens=False).ids for t in texts]
    got: list[list[int] | None] = [None] * len(texts)

    def work(i: int) -> None:
        got[i] = tok.encode(texts[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == expected
