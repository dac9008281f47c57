"""The cache salt's formula, pinned: the first 8 bytes, little-endian, of BLAKE2b over ``model \\0 lora \\0
tenant`` (an absent part is the empty string). Every router, cache-manager and zone must compute the same salt
for the same model, LoRA and tenant, or their hashes never match; so the exact values are fixed here."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest

from kvmesh.index import hashing
from kvmesh.index.hashing import (
    BlockHasher,
    compute_block_hashes,
    compute_block_hashes_numpy,
    finalize,
    make_salt,
    sha256_block_ids,
    unfinalize,
)
from tests.unit.index.test_hashing import reference_hashes

pytestmark = pytest.mark.unit


def formula(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def test_the_salt_is_blake2b_8_little_endian_of_the_nul_joined_parts() -> None:
    assert make_salt("m", "l", "t") == formula(b"m\0l\0t")
    assert make_salt("m") == formula(b"m\0\0")
    assert make_salt("m", tenant="t") == formula(b"m\0\0t")
    assert make_salt("m", lora="l") == formula(b"m\0l\0")


def test_the_salt_values_are_fixed() -> None:
    assert make_salt("m") == 0x9B4E9DC18DD57B53
    assert make_salt("m", "l", "t") == 0x12B4922225864250
    assert make_salt("Qwen/Qwen2.5-0.5B", None, "acme") == 0x17098FD24F8C290D


def test_absent_and_empty_parts_are_the_same_and_parts_do_not_run_together() -> None:
    assert make_salt("m", None, None) == make_salt("m", "", "")
    assert make_salt("m", "l") != make_salt("m", None, "l")  # the separator keeps lora and tenant apart
    assert make_salt("ml") != make_salt("m", "l")
    assert 0 <= make_salt("m") < 2**64


def test_the_salt_changes_every_hash_of_a_prompt() -> None:
    tokens = list(range(32))
    a = compute_block_hashes(tokens, 16, make_salt("m", tenant="a"))
    b = compute_block_hashes(tokens, 16, make_salt("m", tenant="b"))
    assert len(a) == len(b) == 2 and all(x != y for x, y in zip(a, b, strict=True))


# The routing hash's values, pinned like the salt's: routers, cache managers and zones hash prompts on their own
# and must agree, so a changed constant (P, the root, the finaliser, the K derivation) or step shows here. The
# values were computed once from the formula in the module docstring (and agree with `reference_hashes`, the
# step-by-step recurrence); both the C kernel's path and the numpy reference are held to them.
FIXED_0_TO_31_BS16 = [0x7E919C163D30F0CA, 0xDFB8E5BDD4276789]
FIXED_0_TO_31_BS16_SALT_M = [0x15E9FD940F4E51C0, 0x8BF8AB00D7BE9D88]
FIXED_0_TO_5_BS3_SALT7_PARENT = [0x84D9600907B4BB25, 0x6D12F89FAB719516]


def test_the_routing_hash_values_are_fixed() -> None:
    tokens = list(range(32))
    for compute in (compute_block_hashes, compute_block_hashes_numpy):
        assert compute(tokens, 16).tolist() == FIXED_0_TO_31_BS16
        assert compute(tokens, 16, make_salt("m")).tolist() == FIXED_0_TO_31_BS16_SALT_M
        assert compute(list(range(6)), 3, 7, 0x1234).tolist() == FIXED_0_TO_5_BS3_SALT7_PARENT
    assert reference_hashes(tokens, 16, 0) == FIXED_0_TO_31_BS16


def test_the_finaliser_values_are_fixed_and_it_inverts() -> None:
    assert finalize(0) == 0 and finalize(1) == 0xBF584768E626DED1
    assert unfinalize(0) == 0 and unfinalize(1) == 0x96DE1B17A9CF8B9E
    for x in (1, 0xBF584768E626DED1, (1 << 64) - 1, 1 << 63, 1 << 31, 0x123456789ABCDEF0):
        assert unfinalize(finalize(x)) == x and finalize(unfinalize(x)) == x


def test_a_process_with_cold_caches_computes_the_same_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The constant and power tables and the chain roots are per-process caches, filled on first use: a fresh
    process (empty caches, then growing past the first table size) must hash exactly as a warm one."""
    monkeypatch.setattr(hashing, "_TABLES", hashing._Tables())
    monkeypatch.setattr(hashing, "_ROOTS", {})
    tokens = list(range(32))
    assert compute_block_hashes_numpy(tokens[:16], 16).tolist() == FIXED_0_TO_31_BS16[:1]
    assert compute_block_hashes_numpy(tokens, 16).tolist() == FIXED_0_TO_31_BS16
    assert compute_block_hashes(tokens, 16, make_salt("m")).tolist() == FIXED_0_TO_31_BS16_SALT_M
    rng = np.random.default_rng(11)
    # the power tables start at 1024 entries, then double, or grow to n when n is more than double
    for n_blocks in (1, 2, 3, 700, 1500, 2100, 8500):
        long = rng.integers(0, 2**32, size=n_blocks * 2).tolist()
        assert compute_block_hashes_numpy(long, 2, salt=5).tolist() == reference_hashes(long, 2, 5), n_blocks


def test_continuing_a_chain_from_a_parent_needs_no_table_but_the_constants() -> None:
    tokens = list(range(48))
    whole = compute_block_hashes(tokens, 16, salt=3)
    for compute in (compute_block_hashes, compute_block_hashes_numpy):
        assert compute(tokens[16:], 16, 3, int(whole[0])).tolist() == whole[1:].tolist()
        assert compute(tokens[32:], 16, 3, int(whole[1])).tolist() == whole[2:].tolist()
    # the parent is taken modulo 2^64, as every hash is
    assert compute_block_hashes(tokens[16:], 16, 3, int(whole[0]) + (1 << 64)).tolist() == whole[1:].tolist()


@pytest.mark.parametrize("block_size", [0, -1])
def test_a_block_size_below_1_is_refused_by_every_entry_point(block_size: int) -> None:
    for call in (
        lambda: compute_block_hashes([1, 2], block_size),
        lambda: compute_block_hashes_numpy([1, 2], block_size),
        lambda: BlockHasher(block_size),
        lambda: sha256_block_ids([1, 2], block_size, b""),
    ):
        with pytest.raises(ValueError, match=r"^block_size must be positive$"):
            call()


def test_a_block_size_of_1_hashes_every_token() -> None:
    assert len(compute_block_hashes([5, 6, 7], 1)) == 3 and len(compute_block_hashes_numpy([5, 6, 7], 1)) == 3
    assert len(BlockHasher(1).hashes([5, 6, 7])) == 3 and len(sha256_block_ids([5, 6, 7], 1, b"")) == 3


def test_a_prompt_shorter_than_a_block_has_no_hash() -> None:
    for compute in (compute_block_hashes, compute_block_hashes_numpy):
        got = compute(list(range(15)), 16)
        assert got.dtype == np.uint64 and got.shape == (0,)
    assert sha256_block_ids(list(range(15)), 16, b"s") == []


def test_the_block_hasher_binds_block_size_and_salt_and_passes_the_parent() -> None:
    tokens = list(range(48))
    hasher = BlockHasher(16, salt=42)
    assert (hasher.block_size, hasher.salt) == (16, 42)
    assert BlockHasher(16).salt == 0
    whole = hasher.hashes(tokens)
    assert whole.tolist() == compute_block_hashes(tokens, 16, 42).tolist()
    assert hasher.hashes(tokens[16:], parent=int(whole[0])).tolist() == whole[1:].tolist()


def test_the_kv_data_ids_follow_their_documented_formula() -> None:
    """id_{-1} = SHA-256(b"kvmesh-kv-root" || salt), id_i = SHA-256(id_{i-1} || salt || tokens_i as u32 LE)."""
    tokens, salt = [1, 2, 0xFFFFFFFF, 4, 9], b"s"
    prev = hashlib.sha256(b"kvmesh-kv-root" + salt).digest()
    want = []
    for i in range(2):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[2 * i : 2 * i + 2])
        prev = hashlib.sha256(prev + salt + block).digest()
        want.append(prev)
    assert sha256_block_ids(tokens, 2, salt) == want
    assert sha256_block_ids(np.array(tokens, dtype=np.uint64), 2, salt) == want
    assert sha256_block_ids([1, 2, 3, 4], 2, b"s")[1].hex() == (
        "68004aa6c46abfb3b7377fb0cf0d5a394f35421cb441f8eb2c550ffcad36ee0c"
    )


@pytest.mark.parametrize("token", [-1, 0x1_0000_0000])
def test_kv_data_ids_refuse_a_token_outside_uint32(token: int) -> None:
    with pytest.raises(ValueError, match=r"^token ids must fit in uint32$"):
        sha256_block_ids([0, token], 1, b"")


def test_kv_data_ids_take_both_ends_of_uint32() -> None:
    assert len(sha256_block_ids([0, 0xFFFFFFFF], 1, b"")) == 2
    assert sha256_block_ids([], 1, b"") == []


def test_the_native_loader_returns_the_kernel_or_none_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """`compute_block_hashes` falls back to numpy when `kvmesh.index._native` cannot be imported."""
    try:
        from kvmesh.index._native import hash_blocks
    except ImportError:
        hash_blocks = None
    assert hashing._load_kernel() is hash_blocks
    monkeypatch.setitem(sys.modules, "kvmesh.index._native", None)  # an import of it now raises ImportError
    assert hashing._load_kernel() is None
    monkeypatch.setattr(hashing, "_hash_blocks", None)
    assert compute_block_hashes(list(range(32)), 16).tolist() == FIXED_0_TO_31_BS16


# Input types: the numpy reference takes any sequence of non-negative ints or integer array; lists go through a
# uint32 buffer, larger ids through int64; signed arrays are reinterpreted as unsigned of the same width (not
# copied), narrower or non-integer arrays converted to uint64. The C path must agree for every input.


def _both(tokens: object, block_size: int, salt: int = 0, parent: int | None = None) -> list[int]:
    """The hashes from the C path and from the numpy reference, which must be equal."""
    native = compute_block_hashes(tokens, block_size, salt, parent).tolist()  # type: ignore[arg-type]
    reference = compute_block_hashes_numpy(tokens, block_size, salt, parent).tolist()  # type: ignore[arg-type]
    assert native == reference
    return reference


def test_lists_tuples_and_arrays_of_the_same_ids_hash_alike() -> None:
    ids = [0, 1, 2**31, 2**32 - 1, 7, 150_000]
    want = reference_hashes(ids, 2, 9)
    for variant in (ids, tuple(ids), np.array(ids, dtype=np.uint32), np.array(ids, dtype=np.uint64)):
        assert _both(variant, 2, 9) == want
    assert _both(np.array([1, 2, 3, 4], dtype=np.int64), 2, 9) == reference_hashes([1, 2, 3, 4], 2, 9)


def test_ids_past_uint32_in_a_list_are_hashed_whole() -> None:
    ids = [2**32, 3, 2**40 + 5, 2**63 - 1]
    assert _both(ids, 2, 4) == reference_hashes(ids, 2, 4)
    assert _both(ids, 2, 4) == _both(np.array(ids, dtype=np.uint64), 2, 4)


def test_ids_past_int64_are_refused_by_both_paths() -> None:
    for compute in (compute_block_hashes, compute_block_hashes_numpy):
        with pytest.raises(OverflowError):
            compute([2**63, 1], 1)


def test_signed_ids_are_reinterpreted_as_unsigned_of_their_width() -> None:
    assert _both([-1, 2], 1) == _both(np.array([2**64 - 1, 2], dtype=np.uint64), 1)  # a list: int64
    assert _both(np.array([-1, 2], dtype=np.int64), 1) == reference_hashes([2**64 - 1, 2], 1, 0)
    assert _both(np.array([-1, 2], dtype=np.int32), 1) == reference_hashes([2**32 - 1, 2], 1, 0)
    assert _both(np.array([-1, 2], dtype=np.int16), 1) == reference_hashes([2**64 - 1, 2], 1, 0)


def test_narrow_and_non_integer_arrays_hash_as_their_values() -> None:
    want = reference_hashes(list(range(6)), 3, 7)
    for dtype in (np.uint8, np.int8, np.uint16, np.int16, np.float64, np.float32):
        assert compute_block_hashes_numpy(np.arange(6, dtype=dtype), 3, 7).tolist() == want, dtype
    assert compute_block_hashes(np.arange(6, dtype=np.float64), 3, 7, 0x1234).tolist() == FIXED_0_TO_5_BS3_SALT7_PARENT
    assert compute_block_hashes(range(6), 3, 7, 0x1234).tolist() == FIXED_0_TO_5_BS3_SALT7_PARENT  # type: ignore[arg-type]


def test_lists_tuples_and_integer_arrays_take_the_c_kernel_when_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of the kernel is the hot path: with it built, those inputs never reach the numpy reference."""
    if hashing._hash_blocks is None:
        pytest.skip("kvmesh.index._native is not built (pip install -e . compiles it)")

    def numpy_path(*_args: object) -> None:
        raise AssertionError("the numpy reference ran")

    monkeypatch.setattr(hashing, "compute_block_hashes_numpy", numpy_path)
    tokens = list(range(32))
    for variant in (tokens, tuple(tokens), np.arange(32, dtype=np.int64), np.arange(32, dtype=np.uint32)):
        assert compute_block_hashes(variant, 16).tolist() == FIXED_0_TO_31_BS16
        assert compute_block_hashes(variant, 16, make_salt("m")).tolist() == FIXED_0_TO_31_BS16_SALT_M
    assert compute_block_hashes(list(range(6)), 3, 7, 0x1234).tolist() == FIXED_0_TO_5_BS3_SALT7_PARENT
    assert compute_block_hashes([], 16).tolist() == []
