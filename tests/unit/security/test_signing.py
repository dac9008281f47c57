"""kvmesh.security.signing: the canonical string, HMAC-SHA256 in hex and base64, the replay window, exact
replays and the bounded replay memory."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from kvmesh.client import AsyncClient
from kvmesh.core.errors import Unauthenticated
from kvmesh.security.signing import (
    ReplayGuard,
    SignedRequest,
    canonical_string,
    sign,
    signature_bytes,
    signing_headers,
    verify,
)

pytestmark = pytest.mark.unit
SECRET = "s3cret"
BODY = b'{"prompt": "hi", "max_tokens": 4}'
T = 1_800_000_000


def req(sig: str | None, ts: str | None, body: bytes = BODY, path: str = "/v1/completions") -> SignedRequest:
    return SignedRequest("POST", path, body, sig, ts)


def test_canonical_string_and_signature_follow_the_documented_formula() -> None:
    digest = hashlib.sha256(BODY).hexdigest()
    want = f"kvmesh-v1\nPOST\n/v1/completions\n{digest}\n{T}".encode()
    assert canonical_string("post", "/v1/completions", BODY, T) == want
    assert sign(SECRET, "POST", "/v1/completions", BODY, T) == hmac.new(b"s3cret", want, hashlib.sha256).hexdigest()
    h = signing_headers(SECRET, "POST", "/v1/completions", BODY, T + 0.9)
    assert h == {"X-Kvmesh-Timestamp": str(T), "X-Kvmesh-Signature": sign(SECRET, "POST", "/v1/completions", BODY, T)}


def test_hex_and_both_base64_alphabets_verify_inside_the_window() -> None:
    raw = signature_bytes(SECRET, "POST", "/v1/completions", BODY, T)
    forms = [raw.hex(), raw.hex().upper(), base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()]
    forms.append(base64.urlsafe_b64encode(raw).decode().rstrip("="))
    for form in forms:
        assert verify(SECRET, req(form, str(T)), now=T + 299.0) == (raw, T)
    assert verify(SECRET, req(raw.hex(), str(T)), now=T - 300.0)[1] == T  # a clock 300 s behind the client


@pytest.mark.parametrize("now", [T + 300.5, T - 301.0, T + 10_000])
def test_timestamp_outside_the_window_is_refused(now: float) -> None:
    with pytest.raises(Unauthenticated, match=r"outside the replay window \(±300 s\)"):
        verify(SECRET, req(sign(SECRET, "POST", "/v1/completions", BODY, T), str(T)), now=now)


def test_any_changed_part_does_not_match() -> None:
    good = sign(SECRET, "POST", "/v1/completions", BODY, T)
    flipped = bytearray(BODY)
    flipped[5] ^= 1
    cases = [
        req(good, str(T), body=bytes(flipped)),  # one body byte
        req(good, str(T), path="/v1/chat/completions"),
        req(good, str(T + 1)),
        SignedRequest("GET", "/v1/completions", BODY, good, str(T)),
        req(sign("other", "POST", "/v1/completions", BODY, T), str(T)),
    ]
    for bad in cases:
        with pytest.raises(Unauthenticated, match="signature does not match"):
            verify(SECRET, bad, now=T)


@pytest.mark.parametrize(
    ("sig", "ts", "message"),
    [
        (None, str(T), "missing X-Kvmesh-Signature"),
        ("ab" * 32, None, "missing X-Kvmesh-Timestamp"),
        ("zz" * 32, str(T), "64 hex characters or base64"),
        ("ab" * 16, str(T), "64 hex characters or base64"),
        ("ab" * 32, "1.5e9", "unix seconds"),
        ("ab" * 32, "", "unix seconds"),
        ("ab" * 32, "9" * 40, "unix seconds"),
    ],
)
def test_malformed_headers_name_what_is_wrong(sig: str | None, ts: str | None, message: str) -> None:
    with pytest.raises(Unauthenticated, match=message):
        verify(SECRET, req(sig, ts), now=T)


def test_replay_guard_refuses_an_exact_replay_until_its_window_ends() -> None:
    g = ReplayGuard(window_s=300, capacity=10)
    g.admit(b"a" * 32, T, now=T)
    with pytest.raises(Unauthenticated, match="replayed"):
        g.admit(b"a" * 32, T, now=T + 200)
    g.admit(b"b" * 32, T, now=T + 1)  # another signature is fine
    g.admit(b"c" * 32, T + 400, now=T + 400.5)  # the first two expired (T + 300 < now) and are forgotten
    assert len(g) == 1


def test_replay_guard_memory_is_bounded_forgetting_the_first_to_expire() -> None:
    g = ReplayGuard(window_s=300, capacity=3)
    for i, ts in enumerate((T + 5, T, T + 9, T + 7)):
        g.admit(bytes([i]) * 32, ts, now=T + 10)
    assert len(g) == 3
    g.admit(bytes([1]) * 32, T, now=T + 10)  # ts T expired first: forgotten, so admitted again
    with pytest.raises(Unauthenticated):
        g.admit(bytes([2]) * 32, T + 9, now=T + 10)
    off = ReplayGuard(capacity=0)
    off.admit(b"x" * 32, T, now=T)
    off.admit(b"x" * 32, T, now=T)  # disabled: nothing remembered
    assert len(off) == 0


def test_kvmesh_client_stamps_each_attempt_later_than_the_last() -> None:
    """Two attempts of one request (same bytes) never carry the same signature: the router's replay guard
    would refuse the second."""
    c = AsyncClient(routers=["127.0.0.1:1"], api_key="sk", signing_secret=SECRET)
    first, ts1 = c._metadata(BODY, 0)
    again, ts2 = c._metadata(BODY, ts1)
    assert ts2 > ts1
    md1, md2 = dict(first), dict(again)
    assert md1["authorization"] == "Bearer sk" and md1["x-kvmesh-signature"] != md2["x-kvmesh-signature"]
    path = "/kvmesh.v1.RouterService/Generate"
    assert md2["x-kvmesh-signature"] == sign(SECRET, "POST", path, BODY, ts2) and md2["x-kvmesh-timestamp"] == str(ts2)
    assert dict(AsyncClient(routers=["127.0.0.1:1"])._metadata(BODY, 0)[0]) == {}
