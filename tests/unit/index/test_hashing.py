"""Block hashing: closed-form chain equals the step-by-step recurrence; continuation, salts, input types."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.index.hashing import (
    BlockHasher,
    compute_block_hashes,
    finalize,
    make_salt,
    sha256_block_ids,
    unfinalize,
)

pytestmark = pytest.mark.unit
MASK = (1 << 64) - 1
P = 0x9E3779B97F4A7C15


def reference_hashes(tokens: list[int], block_size: int, salt: int) -> list[int]:
    """The documented recurrence, one block at a time with Python ints."""
    from kvmesh.index.hashing import _ROOT, _TABLES, _splitmix64

    k = [int(x) for x in _TABLES.consts(block_size)]
    state = _splitmix64((salt ^ _ROOT) & MASK)
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        c = sum(t * kk for t, kk in zip(block, k, strict=True)) & MASK
        state = (P * state + c) & MASK
        out.append(finalize(state))
    return out


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("n_tokens", [0, 5, 64, 1000])
def test_closed_form_matches_recurrence(block_size: int, n_tokens: int) -> None:
    rng = np.random.default_rng(block_size * 7919 + n_tokens)
    tokens = rng.integers(0, 2**32, size=n_tokens).tolist()
    got = compute_block_hashes(tokens, block_size, salt=12345).tolist()
    assert got == reference_hashes(tokens, block_size, 12345)
    assert len(got) == n_tokens // block_size


def test_continuation_from_parent_equals_whole_prompt() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 150_000, size=16 * 40 + 7)
    whole = compute_block_hashes(tokens, 16, salt=9)
    head = compute_block_hashes(tokens[: 16 * 13], 16, salt=9)
    tail = compute_block_hashes(tokens[16 * 13 :], 16, salt=9, parent=int(head[-1]))
    assert np.array_equal(np.concatenate([head, tail]), whole)


def test_input_types_agree() -> None:
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 2**31 - 1, size=1024)
    ref = compute_block_hashes(tokens, 16)
    for variant in (tokens.tolist(), tokens.astype(np.int32), tokens.astype(np.uint32), tokens.astype(np.uint64)):
        assert np.array_equal(compute_block_hashes(variant, 16), ref)
    assert np.array_equal(BlockHasher(16).hashes(tokens), ref)


def test_prefix_property_and_sensitivity() -> None:
    rng = np.random.default_rng(3)
    a = rng.integers(0, 50_000, size=16 * 8)
    b = a.copy()
    b[16 * 5 + 3] += 1  # change one token of block 5
    ha, hb = compute_block_hashes(a, 16), compute_block_hashes(b, 16)
    assert np.array_equal(ha[:5], hb[:5])
    assert not np.any(ha[5:] == hb[5:])
    # swapping two whole blocks changes every hash from the first swapped block on
    c = a.copy()
    c[16:32], c[32:48] = a[32:48], a[16:32]
    hc = compute_block_hashes(c, 16)
    assert hc[0] == ha[0] and not np.any(hc[1:] == ha[1:])


def test_salts_separate_models_loras_tenants() -> None:
    salts = {
        make_salt("m"),
        make_salt("m", lora="l"),
        make_salt("m", tenant="t"),
        make_salt("m", "l", "t"),
        make_salt("m2"),
    }
    assert len(salts) == 5
    assert make_salt("m", "l", "t") == make_salt("m", "l", "t")
    tokens = list(range(64))
    h1, h2 = compute_block_hashes(tokens, 16, make_salt("m")), compute_block_hashes(tokens, 16, make_salt("m2"))
    assert not np.any(h1 == h2)


def test_no_collisions_on_many_random_blocks() -> None:
    rng = np.random.default_rng(4)
    hs = compute_block_hashes(rng.integers(0, 1000, size=16 * 200_000), 16)
    assert np.unique(hs).shape[0] == hs.shape[0]


def test_finalize_is_a_bijection_on_samples() -> None:
    rng = np.random.default_rng(5)
    for x in [*rng.integers(0, 2**63, size=500).tolist(), 0, MASK, 1 << 63]:
        assert unfinalize(finalize(x)) == x


def test_sha256_block_ids_are_chained_and_salted() -> None:
    tokens = list(range(40))
    ids = sha256_block_ids(tokens, 16, b"tenant-a")
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)
    assert sha256_block_ids(tokens[:16], 16, b"tenant-a") == ids[:1]
    assert sha256_block_ids(tokens, 16, b"tenant-b")[0] != ids[0]
    changed = [99, *tokens[1:]]
    assert sha256_block_ids(changed, 16, b"tenant-a")[1] != ids[1]  # chained: block 1 depends on block 0


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        compute_block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        sha256_block_ids([-1], 1, b"")


@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
def test_native_kernel_equals_numpy_reference_on_random_inputs(block_size: int) -> None:
    """The C kernel (when built) and the numpy closed form agree for every input type, salt and parent."""
    from kvmesh.index import hashing

    if hashing._hash_blocks is None:
        pytest.skip("kvmesh.index._native is not built (pip install -e . compiles it)")
    rng = np.random.default_rng(block_size)
    for trial in range(40):
        n = int(rng.integers(0, 3000))
        tokens = rng.integers(0, 2**32 if trial % 2 else 200_000, size=n)
        salt = int(rng.integers(0, 2**63))
        parent = None if trial % 3 else int(rng.integers(0, 2**63))
        ref = hashing.compute_block_hashes_numpy(tokens, block_size, salt, parent)
        variants = [tokens, tokens.tolist(), tuple(tokens.tolist()), tokens.astype(np.uint32), tokens.astype(np.uint64)]
        variants += [np.repeat(tokens, 2)[::2], tokens.astype(np.int64).view(np.uint64)]
        if trial % 2 == 0:
            variants += [tokens.astype(np.int32), tokens.astype(np.uint32).astype(np.int64)]
        for v in variants:
            got = compute_block_hashes(v, block_size, salt, parent)
            assert got.dtype == np.uint64 and np.array_equal(got, ref), type(v)
    small = np.arange(256, dtype=np.uint8)
    assert np.array_equal(compute_block_hashes(small, 16), hashing.compute_block_hashes_numpy(small, 16))
    assert np.array_equal(
        compute_block_hashes(small.astype(np.int16), 16), hashing.compute_block_hashes_numpy(small, 16)
    )
