"""Token ids -> chained block hashes (pure, vectorised numpy).

Routing hashes
--------------
A prompt of ``T`` tokens has ``n = T // B`` full blocks of ``B`` tokens (a trailing partial block gets no
hash). Block ``i`` (tokens ``t[i, 0..B-1]``) gets

    c_i = sum_k  t[i, k] * K_k                     (mod 2^64; K_k odd constants derived from B)
    s_i = P * s_{i-1} + c_i                         (mod 2^64; P odd, s_{-1} = root(salt) or F^-1(parent))
    h_i = F(s_i)                                    (F: xorshift-multiply-xorshift finaliser, a bijection)

so ``h_i = H(h_{i-1}, tokens_i)`` with the salt entering through the chain root: a hash identifies its whole
prefix (and salt). The recurrence is evaluated in closed form, without a Python loop:

    s_i = P^i * (P * s_{-1} + sum_{j<=i} c_j * P^{-j})      (P^{-1} the inverse of P modulo 2^64)

i.e. one matrix-vector product, one cumulative sum and a handful of element-wise uint64 ops (all wrapping).
That is :func:`compute_block_hashes_numpy`, the reference. :func:`compute_block_hashes` runs the sequential
recurrence in C (``kvmesh.index._native.hash_blocks``, same outputs, no numpy call overhead, reads Python
lists directly) when the extension is built, and falls back to the reference otherwise or for inputs the C
path does not take (non-integer or multi-dimensional arrays).

These are *routing* hashes: fast and non-cryptographic. A collision only sends a request to a worker that
does not have the prefix (a cache miss). Anything that identifies KV *data* (kv-sync, an offload tier) must
use a collision-resistant identity: :func:`sha256_block_ids` (chained SHA-256), never these hashes.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt


def _load_kernel() -> Callable[[Any, Any, int, Any], None] | None:
    """The C kernel ``hash_blocks(tokens, K, base, out)``, or None when the extension is not built."""
    try:
        from kvmesh.index._native import hash_blocks
    except ImportError:
        return None
    return hash_blocks


_hash_blocks = _load_kernel()

__all__ = [
    "BlockHasher",
    "compute_block_hashes",
    "compute_block_hashes_numpy",
    "finalize",
    "make_salt",
    "sha256_block_ids",
    "unfinalize",
]

_MASK = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # odd: invertible modulo 2^64
_P_INV = pow(_P, -1, 1 << 64)
_M = 0xBF58476D1CE4E5B9  # odd finaliser multiplier
_M_INV = pow(_M, -1, 1 << 64)
_ROOT = 0x6A09E667F3BCC909
_S1 = np.uint64(32)
_S2 = np.uint64(29)
_M_U64 = np.uint64(_M)

U64Array = npt.NDArray[np.uint64]
_UNSIGNED = {4: np.uint32, 8: np.uint64}


def _splitmix64(x: int) -> int:
    """splitmix64 finaliser on a Python int (used to derive constants and roots)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def finalize(s: int) -> int:
    """F(s) = y ^ (y >> 29) with y = M * (s ^ (s >> 32)) mod 2^64 (a bijection on 64-bit ints)."""
    y = ((s ^ (s >> 32)) * _M) & _MASK
    return y ^ (y >> 29)


def unfinalize(h: int) -> int:
    """F^-1(h): recover the chain state behind a published hash (used to continue a chain from a parent)."""
    y = h ^ (h >> 29) ^ (h >> 58)
    x = (y * _M_INV) & _MASK
    return x ^ (x >> 32)


def make_salt(model: str, lora: str | None = None, tenant: str | None = None) -> int:
    """64-bit salt = first 8 bytes (little-endian) of blake2b(model \\0 lora \\0 tenant)."""
    text = "\0".join((model, lora or "", tenant or ""))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class _Tables:
    """Per-process caches: K constants per block size, P^i and P^-i up to the longest prompt seen."""

    def __init__(self) -> None:
        self.k: dict[int, U64Array] = {}
        self.ppow: U64Array = np.ones(1, dtype=np.uint64)
        self.pinv: U64Array = np.ones(1, dtype=np.uint64)

    def consts(self, block_size: int) -> U64Array:
        k = self.k.get(block_size)
        if k is None:
            vals = [_splitmix64((block_size << 32) + i) | 1 for i in range(block_size)]
            k = np.array(vals, dtype=np.uint64)
            self.k[block_size] = k
        return k

    def powers(self, n: int) -> tuple[U64Array, U64Array]:
        if self.ppow.shape[0] < n:
            size = max(n, 2 * self.ppow.shape[0], 1024)
            p = np.full(size, _P, dtype=np.uint64)
            q = np.full(size, _P_INV, dtype=np.uint64)
            p[0] = q[0] = 1
            self.ppow = np.cumprod(p, dtype=np.uint64)
            self.pinv = np.cumprod(q, dtype=np.uint64)
        return self.ppow, self.pinv


_TABLES = _Tables()
_ROOTS: dict[int, int] = {}  # salt -> P * root(salt), memoised


def _as_token_array(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.unsignedinteger]:
    """Token ids as an unsigned array without copying when possible (lists go through array('I'): fast)."""
    if not isinstance(token_ids, np.ndarray):
        try:
            return np.frombuffer(array.array("I", token_ids), dtype=np.uint32)
        except OverflowError:
            token_ids = np.asarray(token_ids, dtype=np.int64)
    kind = token_ids.dtype.kind
    if kind == "u":
        return token_ids  # type: ignore[return-value]
    if kind == "i" and token_ids.dtype.itemsize >= 4:
        return token_ids.view(_UNSIGNED[token_ids.dtype.itemsize])
    return token_ids.astype(np.uint64)


def _chain_base(salt: int, parent: int | None) -> int:
    """P * s_{-1}: s_{-1} = splitmix64(salt ^ R) for a new chain, F^-1(parent) to continue one."""
    if parent is not None:
        return (unfinalize(parent & _MASK) * _P) & _MASK
    base = _ROOTS.get(salt)
    if base is None:
        base = _ROOTS[salt] = (_splitmix64((salt ^ _ROOT) & _MASK) * _P) & _MASK
    return base


def compute_block_hashes(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    block_size: int,
    salt: int = 0,
    parent: int | None = None,
) -> U64Array:
    """Chained routing hashes (uint64), one per FULL block; see the module docstring for the formula.

    ``parent`` continues an existing chain: ``compute_block_hashes(t[:a*B] + t2, B, salt)[a:]`` equals
    ``compute_block_hashes(t2, B, salt, parent=h[a-1])``. Without a parent the root is ``splitmix64(salt ^ R)``.
    Token ids must be non-negative (signed arrays are reinterpreted, not copied). Uses the C kernel when
    built; equal to :func:`compute_block_hashes_numpy` for every input.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if _hash_blocks is not None and isinstance(token_ids, list | tuple | np.ndarray):
        out: U64Array = np.empty(len(token_ids) // block_size, dtype=np.uint64)
        try:
            _hash_blocks(token_ids, _TABLES.consts(block_size), _chain_base(salt, parent), out)
            return out
        except TypeError:  # e.g. float or 2-d arrays: the numpy path decides
            pass
    return compute_block_hashes_numpy(token_ids, block_size, salt, parent)


def compute_block_hashes_numpy(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    block_size: int,
    salt: int = 0,
    parent: int | None = None,
) -> U64Array:
    """The vectorised numpy reference of :func:`compute_block_hashes` (closed form of the recurrence)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    toks = _as_token_array(token_ids)
    n = toks.shape[0] // block_size
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    k = _TABLES.consts(block_size)
    ppow, pinv = _TABLES.powers(n)
    base = _chain_base(salt, parent)
    c: U64Array = toks[: n * block_size].reshape(n, block_size) @ k
    c *= pinv[:n]
    c[0] = (int(c[0]) + base) & _MASK
    np.add.accumulate(c, out=c)
    c *= ppow[:n]
    c ^= c >> _S1
    c *= _M_U64
    c ^= c >> _S2
    return c


class BlockHasher:
    """Convenience wrapper binding a block size and a salt."""

    __slots__ = ("block_size", "salt")

    def __init__(self, block_size: int, salt: int = 0) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.salt = salt

    def hashes(self, token_ids: Sequence[int] | npt.NDArray[np.integer], parent: int | None = None) -> U64Array:
        return compute_block_hashes(token_ids, self.block_size, self.salt, parent)


def sha256_block_ids(
    token_ids: Sequence[int] | npt.NDArray[np.integer], block_size: int, salt_bytes: bytes
) -> list[bytes]:
    """Collision-resistant KV-data identities: id_i = SHA-256(id_{i-1} || salt || tokens_i as u32 LE).

    id_{-1} = SHA-256(b"kvmesh-kv-root" || salt). Use these (not routing hashes) for anything that moves or
    reuses KV data, where a collision would serve one tenant's cache to another.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    toks = np.asarray(token_ids, dtype=np.int64)
    if toks.size and (toks.min() < 0 or toks.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    data = toks.astype("<u4").tobytes()
    step = 4 * block_size
    prev = hashlib.sha256(b"kvmesh-kv-root" + salt_bytes).digest()
    out: list[bytes] = []
    for i in range(toks.shape[0] // block_size):
        prev = hashlib.sha256(prev + salt_bytes + data[i * step : (i + 1) * step]).digest()
        out.append(prev)
    return out
