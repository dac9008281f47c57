"""Router auth: API keys (plain and YAML files, SHA-256 lookup confirmed in constant time), per-key signing
rules, tenants bound to keys, and per-key token-bucket rate limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.core.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated
from kvmesh.security.client_keys import ClientKey, ClientKeys, bind_tenant, default_key_id, parse_keys_text
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.signing import SignedRequest, sign
from kvmesh.services.router.auth import RateLimiter

pytestmark = pytest.mark.unit
T = 1_800_000_000
YAML = """
# alice may use two tenants; bob must sign
- key: sk-alice
  id: alice
  tenants: [alice, shared]
- key: sk-bob
  id: bob
  tenants: bob
  signing_secret: bob-secret
  require_signature: true
- key: sk-ops
  id: ops
  role: admin
"""


CAROL = "spiffe://kvmesh/-/client/carol"


def unsigned(body: bytes = b"{}") -> SignedRequest:
    return SignedRequest("POST", "/v1/completions", body)


def signed(secret: str, ts: int = T, body: bytes = b"{}") -> SignedRequest:
    return SignedRequest("POST", "/v1/completions", body, sign(secret, "POST", "/v1/completions", body, ts), str(ts))


def test_plain_keys_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\nkey-one\n\nkey-two\n")
    monkeypatch.setenv("KVMESH_API_KEYS", "env-key, ")
    keys = ClientKeys.load(str(f))
    assert keys.enabled
    for k in ("key-one", "key-two", "env-key"):
        ident = keys.authenticate(k, unsigned(), T)
        kid = default_key_id(k)
        assert ident == Identity(CallerRole.CLIENT, kid, tenants=(kid,)) and kid.startswith("key-") and k not in kid
    for bad in ("key-on", "key-one ", "", None):
        with pytest.raises(Unauthenticated):
            keys.lookup(bad)


def test_no_keys_means_open() -> None:
    keys = ClientKeys([])
    assert not keys.enabled and keys.authenticate(None, unsigned(), T) is None
    assert bind_tenant(None, "anything") == "anything"  # an open router: tenants as declared, as before keys


@pytest.mark.parametrize("name", ["keys.yaml", "keys"])
def test_yaml_keys_file(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_text(YAML)
    keys = ClientKeys.load(str(f))
    assert keys.authenticate("sk-alice", unsigned(), T) == Identity(
        CallerRole.CLIENT, "alice", tenants=("alice", "shared")
    )
    assert keys.authenticate("sk-ops", unsigned(), T) == Identity(CallerRole.ADMIN, "ops", tenants=("ops",))
    assert keys.authenticate("sk-bob", signed("bob-secret"), T + 5) == Identity(
        CallerRole.CLIENT, "bob", tenants=("bob",)
    )


def test_signing_rules_per_key(tmp_path: Path) -> None:
    f = tmp_path / "keys.yml"
    f.write_text(YAML)
    keys = ClientKeys.load(str(f), window_s=60)
    with pytest.raises(Unauthenticated, match=r"'bob' requires a signed request: missing X-Kvmesh-Signature and"):
        keys.authenticate("sk-bob", unsigned(), T)
    with pytest.raises(Unauthenticated, match="signature does not match"):
        keys.authenticate("sk-bob", signed("wrong"), T)
    with pytest.raises(Unauthenticated, match=r"outside the replay window \(±60 s\)"):
        keys.authenticate("sk-bob", signed("bob-secret"), T + 61)
    keys.authenticate("sk-bob", signed("bob-secret", body=b"[1]"), T)
    with pytest.raises(Unauthenticated, match="replayed"):
        keys.authenticate("sk-bob", signed("bob-secret", body=b"[1]"), T + 1)
    with pytest.raises(Unauthenticated, match="'alice' has no signing secret"):
        keys.authenticate("sk-alice", signed("x"), T)


def test_optional_signing_accepts_both(tmp_path: Path) -> None:
    keys = ClientKeys([ClientKey("sk-c", "carol", ("carol",), signing_secret="c")])
    assert keys.authenticate("sk-c", unsigned(), T) is not None
    assert keys.authenticate("sk-c", signed("c"), T) is not None
    with pytest.raises(Unauthenticated, match="does not match"):
        keys.authenticate("sk-c", signed("not-c"), T)


def test_tenant_bound_to_the_key() -> None:
    alice = Identity(CallerRole.CLIENT, "alice", tenants=("alice", "shared"))
    assert bind_tenant(alice, "") == "alice"
    assert bind_tenant(alice, "shared") == "shared"
    with pytest.raises(PermissionDenied, match="tenant 'bob' is not allowed for client 'alice'"):
        bind_tenant(alice, "bob")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- key: a\n  tenant: x\n", r"keys\[0\]: unknown field\(s\) tenant"),
        ("- key: ''\n", r"keys\[0\].key: must be a non-empty string"),
        ("- id: x\n", r"keys\[0\].key"),
        ("- key: a\n  require_signature: 'yes'\n", "require_signature: must be true or false"),
        ("- key: a\n  require_signature: true\n", "needs signing_secret"),
        ("- key: a\n  role: worker\n", "role: must be one of client, admin"),
        ("- key: a\n  tenants: [1]\n", "tenants: must be a string or a list"),
        ("- key: a\n- key: a\n", "configured once"),
        ("- key: a\n  id: x\n- key: b\n  id: x\n", "configured once"),
        ("- key: a\n  id: [x\n", "keys.yaml"),
        ("keys: 3\n", "want a YAML list"),
        ("- 3\n", "want a mapping"),
        (f"- certificate: {CAROL}\n  key: a\n", r"keys\[0\].key: not with certificate"),
        (f"- certificate: {CAROL}\n  signing_secret: s\n", r"keys\[0\].signing_secret: not with certificate"),
        ("- certificate: https://x/client/carol\n", r"keys\[0\].certificate: not a kvmesh SPIFFE id"),
        ("- certificate: spiffe://kvmesh/-/worker/w0\n", "role worker is a service's"),
        (f"- certificate: {CAROL}\n  role: admin\n", "differs from the certificate's role 'client'"),
        (f"- certificate: {CAROL}\n- certificate: {CAROL}\n", "configured once"),
        (f"- key: a\n  id: carol\n- certificate: {CAROL}\n", "configured once"),
    ],
)
def test_bad_yaml_names_entry_and_field(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(text)
    with pytest.raises(InvalidArgument, match=message) as ei:
        ClientKeys.load(str(f))
    assert ei.value.field == "api_keys_file" and str(f) in ei.value.message


def test_certificates_bound_to_their_tenants() -> None:
    """A certificate entry gives its tenants; a client certificate named by no entry is its own tenant; a role
    token's tenants stay its own; none of this enables key authentication."""
    text = f"- certificate: {CAROL}\n  tenants: [carol, shared]\n- {{certificate: 'spiffe://kvmesh/z/admin/op'}}\n"
    keys = ClientKeys(parse_keys_text(text, yaml_format=True))
    assert not keys.enabled
    carol = keys.for_certificate(Identity(CallerRole.CLIENT, "carol"))
    assert carol == Identity(CallerRole.CLIENT, "carol", "", ("carol", "shared"))
    assert bind_tenant(carol, "shared") == "shared" and bind_tenant(carol, "") == "carol"
    assert keys.for_certificate(Identity(CallerRole.ADMIN, "op", "z")).tenants == ("op",)
    stranger = keys.for_certificate(Identity(CallerRole.CLIENT, "dave", "z"))
    assert stranger == Identity(CallerRole.CLIENT, "dave", "z", ("dave",))
    with pytest.raises(PermissionDenied, match="tenant 'carol' is not allowed for client 'dave'"):
        bind_tenant(stranger, "carol")
    token = Identity(CallerRole.CLIENT, "demo", "z", ("demo", "eval"))
    assert keys.for_certificate(token) == token
    # carol's entry names zone "-": the same id in another zone is another certificate, its own tenant only
    assert keys.for_certificate(Identity(CallerRole.CLIENT, "carol", "zone-b")).tenants == ("carol",)


def test_token_bucket_per_key() -> None:
    rl = RateLimiter(rate=2.0, burst=3)
    for _ in range(3):
        rl.acquire("a", 0.0)
    with pytest.raises(ResourceExhausted) as ei:
        rl.acquire("a", 0.0)
    assert ei.value.retry_after_s == pytest.approx(0.5)
    rl.acquire("b", 0.0)  # other keys are independent
    rl.acquire("a", 0.5)  # one token refilled after 1/rate
    with pytest.raises(ResourceExhausted):
        rl.acquire("a", 0.5)
    RateLimiter(rate=0, burst=1).acquire("x", 0.0)  # disabled


def test_rate_limit_sits_between_the_replay_check_and_the_record() -> None:
    """A signed request the rate limit refuses is not remembered (it may be re-sent as is); a replay is
    refused before it takes a rate-limit token."""
    keys = ClientKeys([ClientKey("sk-c", "carol", ("carol",), signing_secret="c")])
    rl = RateLimiter(rate=1.0, burst=1)
    charged: list[str] = []

    def charge(kid: str) -> None:
        charged.append(kid)
        rl.acquire(kid, 0.0)

    key = keys.lookup("sk-c")
    keys.verify(key, signed("c", body=b"[1]"), T, charge)
    with pytest.raises(ResourceExhausted):
        keys.verify(key, signed("c", body=b"[2]"), T, charge)
    rl = RateLimiter(rate=1.0, burst=5)  # room again
    assert keys.verify(key, signed("c", body=b"[2]"), T, charge) is not None  # the same signature, now admitted
    n = len(charged)
    with pytest.raises(Unauthenticated, match="replayed"):
        keys.verify(key, signed("c", body=b"[2]"), T, charge)
    assert len(charged) == n  # the replay cost no token
    assert ClientKeys([]).verify(None, unsigned(), T, charge) is None and charged[-1] == "anonymous"
