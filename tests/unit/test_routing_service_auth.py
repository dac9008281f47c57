"""Router service auth: API keys (constant-time compare) and per-key token-bucket rate limits."""

import pytest

from kvmesh.errors import ResourceExhausted, Unauthenticated
from kvmesh.services.router.auth import ApiKeys, RateLimiter

pytestmark = pytest.mark.unit


def test_keys_file_and_env(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "keys"
    f.write_text("# comment\nkey-one\n\nkey-two\n")
    monkeypatch.setenv("KVMESH_API_KEYS", "env-key, ")
    keys = ApiKeys.load(str(f))
    assert keys.enabled
    for k in ("key-one", "key-two", "env-key"):
        assert keys.check(k) == k
    for bad in ("key-on", "key-one ", "", None):
        with pytest.raises(Unauthenticated):
            keys.check(bad)


def test_no_keys_means_open() -> None:
    assert ApiKeys([]).check(None) == "anonymous"


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
