"""`HfTokenizer.encode` takes `encode_batch_fast` (no offsets, GIL released): it must give exactly the ids of
the plain `tokenizers` call, for short texts and long ones, on several threads at once."""

from __future__ import annotations

import random
import threading

import pytest

from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.engine.tokenizer import HfTokenizer

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


@pytest.mark.parametrize("n_chars", [1, 2047, 2048, 50_000])
def test_encode_gives_the_plain_ids(tok: HfTokenizer, n_chars: int) -> None:
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
