"""The campaign's traffic on a real engine: prompts inside its vocabulary, one right answer per request."""

from __future__ import annotations

from pathlib import Path

from kvmesh.bench.chaos_suite import Suite, SuiteConfig
from kvmesh.bench.chaos_traffic import MIX, Traffic, TrafficConfig


def traffic(real_vocab: int) -> Traffic:
    return Traffic(Suite(Path("/nonexistent"), SuiteConfig()), TrafficConfig(seed=3, real_vocab=real_vocab), 0.0)


def test_on_a_real_engine_every_request_is_greedy_inside_its_vocabulary_and_has_no_reference_yet() -> None:
    t = traffic(real_vocab=1024)
    assert "n2" not in t.mix and set(t.mix) == set(MIX) - {"n2"}
    for kind in ("session", "short", "long"):
        for _ in range(20):
            prompt, sampling, _session, expected = t._grpc_body(kind)
            assert prompt and all(5 <= tok < 1024 for tok in prompt), kind
            assert sampling.temperature == 0.0 and (sampling.n or 1) == 1 and expected is None


def test_on_the_simulated_engine_the_reference_is_known_at_once_and_n2_is_in_the_mix() -> None:
    t = traffic(real_vocab=0)
    assert t.mix == MIX
    _prompt, sampling, _session, expected = t._grpc_body("n2")
    assert sampling.n == 2 and expected is not None and len(expected) == 2
    assert max(t._grpc_body("session")[0]) >= 1024  # the session prompts are not folded
