"""Signed requests: HMAC-SHA256 over method, path, body digest and a timestamp. Pure: `now` is passed in.

    canonical = "kvmesh-v1\\n" + METHOD + "\\n" + path + "\\n" + hex(SHA-256(body)) + "\\n" + timestamp
    signature = HMAC-SHA256(signing_secret, canonical)

sent as ``X-Kvmesh-Signature`` (lowercase hex, 64 characters, or base64 of the 32 bytes, standard or URL-safe
alphabet, padding optional) and ``X-Kvmesh-Timestamp`` (unix seconds, decimal integer); gRPC metadata
``x-kvmesh-signature`` / ``x-kvmesh-timestamp`` alike. HTTP: METHOD is the request method (``POST``), path the
URL path without the query (``/v1/completions``). gRPC: METHOD is ``POST`` (a gRPC call is an HTTP/2 POST),
path the full method name (``/kvmesh.v1.RouterService/Generate``) and body the serialized request message as
sent on the wire.

A request is accepted when the signature matches (``hmac.compare_digest``) and
``|now − timestamp| ≤ window_s``; :class:`ReplayGuard` refuses the same signature a second time while it is
inside the window.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.core.errors import Unauthenticated

SIGNATURE_HEADER = "X-Kvmesh-Signature"
TIMESTAMP_HEADER = "X-Kvmesh-Timestamp"
SIGNATURE_METADATA = SIGNATURE_HEADER.lower()
TIMESTAMP_METADATA = TIMESTAMP_HEADER.lower()
GRPC_METHOD = "POST"
DEFAULT_WINDOW_S = 300.0
_VERSION = b"kvmesh-v1"
_DIGEST_BYTES = 32


@dataclass(frozen=True, slots=True)
class SignedRequest:
    """What a request offers for verification: the signed parts and the two headers as received (None: absent)."""

    method: str
    path: str
    body: bytes
    signature: str | None = None
    timestamp: str | None = None

    @property
    def signed(self) -> bool:
        """True when either header is present (both are then required)."""
        return self.signature is not None or self.timestamp is not None


def canonical_string(method: str, path: str, body: bytes, timestamp: int) -> bytes:
    """``kvmesh-v1\\nMETHOD\\npath\\nhex(sha256(body))\\ntimestamp`` (METHOD upper-cased)."""
    digest = hashlib.sha256(body).hexdigest()
    return b"\n".join((_VERSION, method.upper().encode(), path.encode(), digest.encode(), str(timestamp).encode()))


def signature_bytes(secret: str, method: str, path: str, body: bytes, timestamp: int) -> bytes:
    """HMAC-SHA256(secret, canonical_string(...)), the 32 raw bytes."""
    return hmac.new(secret.encode(), canonical_string(method, path, body, timestamp), hashlib.sha256).digest()


def sign(secret: str, method: str, path: str, body: bytes, timestamp: int) -> str:
    """The ``X-Kvmesh-Signature`` value: lowercase hex of :func:`signature_bytes`."""
    return signature_bytes(secret, method, path, body, timestamp).hex()


def signing_headers(secret: str, method: str, path: str, body: bytes, now: float) -> dict[str, str]:
    """Both headers for a request sent at `now` (unix seconds, truncated)."""
    ts = int(now)
    return {SIGNATURE_HEADER: sign(secret, method, path, body, ts), TIMESTAMP_HEADER: str(ts)}


def decode_signature(value: str) -> bytes:
    """The 32 bytes a header carries: 64 hex characters, else base64 (standard or URL-safe, padding optional);
    Unauthenticated naming the header when it is neither."""
    v = value.strip()
    try:
        raw = bytes.fromhex(v) if len(v) == 2 * _DIGEST_BYTES else _b64(v)
    except (ValueError, binascii.Error):
        raw = b""
    if len(raw) != _DIGEST_BYTES:
        raise Unauthenticated(f"{SIGNATURE_HEADER} must be HMAC-SHA256 as 64 hex characters or base64 of 32 bytes")
    return raw


def _b64(v: str) -> bytes:
    padded = v + "=" * (-len(v) % 4)
    alphabet = b"-_" if ("-" in v or "_" in v) else b"+/"
    return base64.b64decode(padded, altchars=alphabet, validate=True)


def parse_timestamp(value: str) -> int:
    """Unix seconds as a decimal integer; Unauthenticated naming the header otherwise."""
    v = value.strip()
    if not v.isascii() or not v.lstrip("-").isdigit() or len(v) > 20:
        raise Unauthenticated(f"{TIMESTAMP_HEADER} must be unix seconds (a decimal integer), got {value[:32]!r}")
    return int(v)


def verify(secret: str, req: SignedRequest, now: float, window_s: float = DEFAULT_WINDOW_S) -> tuple[bytes, int]:
    """Checks both headers, the window (``|now − ts| ≤ window_s``) and the signature (constant time); returns
    (signature bytes, timestamp) for :class:`ReplayGuard`. Unauthenticated naming what is missing or wrong."""
    if req.signature is None or req.timestamp is None:
        raise Unauthenticated(f"signed request incomplete: missing {missing_headers(req)}")
    presented = decode_signature(req.signature)
    ts = parse_timestamp(req.timestamp)
    if abs(now - ts) > window_s:
        raise Unauthenticated(f"{TIMESTAMP_HEADER} outside the replay window (±{window_s:g} s)")
    want = signature_bytes(secret, req.method, req.path, req.body, ts)
    if not hmac.compare_digest(presented, want):
        raise Unauthenticated("signature does not match (HMAC-SHA256 over method, path, body SHA-256, timestamp)")
    return want, ts


def missing_headers(req: SignedRequest) -> str:
    """The signing headers `req` lacks, for an error message ("X-Kvmesh-Signature and X-Kvmesh-Timestamp")."""
    pairs = ((SIGNATURE_HEADER, req.signature), (TIMESTAMP_HEADER, req.timestamp))
    return " and ".join(h for h, v in pairs if v is None)


class ReplayGuard:
    """Signatures accepted within the last window, refused a second time. Bounded: at most `capacity` are
    remembered; past that the one whose window ends first is forgotten early (`capacity` 0 disables).

    A signature is remembered until ``ts + window_s``, after which the timestamp check refuses it anyway."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, capacity: int = 100_000) -> None:
        self.window_s = window_s
        self.capacity = capacity
        self._expiry: list[tuple[float, bytes]] = []  # heap of (ts + window, signature)
        self._seen: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, signature: bytes, timestamp: int, now: float, charge: Callable[[], None] = lambda: None) -> None:
        """Records `signature`; Unauthenticated when it was already admitted inside the window. `charge` runs
        between the check and the record (the rate limit): a request it refuses is not remembered, so it may be
        re-sent with the same signature, and a replay is refused before it costs anything."""
        self._expire(now)
        if signature in self._seen:
            raise Unauthenticated("signed request replayed: this signature was already used inside the window")
        charge()
        if self.capacity <= 0:
            return
        if len(self._seen) >= self.capacity:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        self._seen.add(signature)
        heapq.heappush(self._expiry, (timestamp + self.window_s, signature))

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
