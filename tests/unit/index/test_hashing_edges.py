"""The cache salt's formula, pinned: the first 8 bytes, little-endian, of BLAKE2b over ``model \\0 lora \\0
tenant`` (an absent part is the empty string). Every router, cache-manager and zone must compute the same salt
for the same model, LoRA and tenant, or their hashes never match; so the exact values are fixed here."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.index.hashing import compute_block_hashes, make_salt

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
