"""Canary analysis of a version upgrade (pure): one `Verdict` from the measurements of the old and new version.

What is measured, per version, at each check (`VersionSample`):

- **outputs on the fixed probe set**: the greedy (temperature 0) completion of every probe prompt. Output
  consistency compares *token histograms*: for probe p, ``h_v[p][t]`` = how often token t occurs in version
  v's completion, and

      consistency = mean_p cos(h_old[p], h_new[p]),   cos(a, b) = Σ_t a_t·b_t / (‖a‖·‖b‖)

  (1.0 when the completions hold the same tokens equally often; 0 when they share none). Why histograms of
  greedy tokens and not next-token distributions or embeddings: the worker API returns token ids only (no
  logprobs, no embeddings), for vLLM and the simulated engine alike, and greedy decoding makes the
  completion a function of the model and the prompt. The histogram is insensitive to a token shifting by
  one position (which an exact-match score is not) and tells a changed model (other tokens) from one that
  is merely slower. A probe that either version failed counts in the error rates, not here.
- **latency**: the median wall time of one probe request (``latency_s``), probes of both versions interleaved
  so that load on the host weighs on both alike; ``regression = (lat_new − lat_old) / lat_old``. On live
  traffic, the workers' own median decode-step latency (`LoadReport.decode_latency_p50_ms`, averaged over a
  version's workers) is held to the same bound when both versions report one.
- **memory**: the KV pool a worker has (``kv_blocks_total × block_size`` tokens, from `GetInfo`, averaged
  over a version's workers): the memory an engine leaves for caching after its weights and activations,
  so a version that needs more memory shows as a smaller pool; ``diff = |mem_new − mem_old| / mem_old``.
- **errors**: probe failures / probes sent, and the workers' live error rate (`LoadReport.error_rate`,
  averaged); the new version fails when either exceeds the old one's by more than ``max_error_rate_increase``.

A version with no sample (no up worker of that version) fails the check: nothing can be compared.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.core.errors import InvalidArgument


@dataclass(frozen=True)
class CanaryThresholds:
    """The seed's bounds (000 §5.3): consistency ≥ 0.99, latency regression < 15 %, memory difference < 5 %."""

    min_consistency: float = 0.99
    max_latency_regression: float = 0.15
    max_memory_diff: float = 0.05
    max_error_rate_increase: float = 0.01

    def validated(self) -> CanaryThresholds:
        for name in ("min_consistency", "max_latency_regression", "max_memory_diff", "max_error_rate_increase"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise InvalidArgument(name, f"must be a finite number >= 0, got {v}")
        if self.min_consistency > 1:
            raise InvalidArgument("min_consistency", f"must be <= 1, got {self.min_consistency}")
        return self


@dataclass(frozen=True)
class VersionSample:
    """One version's measurements at one check (see the module docstring)."""

    outputs: Mapping[int, Sequence[int]] = field(default_factory=dict)  # probe index → greedy token ids
    latencies_s: Sequence[float] = ()  # successful probes
    probes: int = 0
    probe_errors: int = 0
    kv_tokens: float = 0.0  # mean KV pool per worker, tokens
    live_error_rate: float = 0.0
    live_decode_p50_ms: float = 0.0  # 0: not reported
    workers: int = 0


@dataclass(frozen=True)
class Verdict:
    """``passed`` when no check failed; ``failed`` names the failed checks (metric labels), ``reasons`` says why."""

    passed: bool
    failed: tuple[str, ...]
    reasons: tuple[str, ...]
    consistency: float = 0.0
    latency_regression: float = 0.0
    memory_diff: float = 0.0


def histogram_cosine(a: Sequence[int], b: Sequence[int]) -> float:
    """cos of the token-count vectors of `a` and `b`; 1.0 for two empty sequences, 0.0 when only one is empty."""
    ha, hb = Counter(a), Counter(b)
    if not ha and not hb:
        return 1.0
    dot = sum(n * hb.get(t, 0) for t, n in ha.items())
    na = math.sqrt(sum(n * n for n in ha.values()))
    nb = math.sqrt(sum(n * n for n in hb.values()))
    return dot / (na * nb) if na and nb else 0.0


def consistency(old: Mapping[int, Sequence[int]], new: Mapping[int, Sequence[int]]) -> float | None:
    """Mean histogram cosine over the probes both versions answered; None when there is none."""
    common = sorted(set(old) & set(new))
    if not common:
        return None
    return sum(histogram_cosine(old[p], new[p]) for p in common) / len(common)


def relative_change(old: float, new: float) -> float:
    """``(new − old) / old``; 0 when both are 0, +inf when only old is 0."""
    if old == 0:
        return 0.0 if new == 0 else math.inf
    return (new - old) / old


def analyse(old: VersionSample, new: VersionSample, th: CanaryThresholds) -> Verdict:
    """Every check of the module docstring; a failure of any one fails the verdict."""
    failed: list[str] = []
    reasons: list[str] = []

    def fail(check: str, why: str) -> None:
        if check not in failed:
            failed.append(check)
        reasons.append(f"{check}: {why}")

    if old.workers == 0 or new.workers == 0:
        which = "old" if old.workers == 0 else "new"
        fail("coverage", f"no up worker of the {which} version to measure")
        return Verdict(False, tuple(failed), tuple(reasons))
    cons = consistency(old.outputs, new.outputs)
    if cons is None:
        fail("consistency", "no probe answered by both versions")
        cons = 0.0
    elif cons < th.min_consistency:
        fail("consistency", f"output histogram cosine {cons:.4f} < {th.min_consistency}")
    lat = 0.0
    if old.latencies_s and new.latencies_s:
        lat = relative_change(statistics.median(old.latencies_s), statistics.median(new.latencies_s))
        if lat >= th.max_latency_regression:
            fail("latency", f"probe median latency +{100 * lat:.1f} % >= {100 * th.max_latency_regression:.0f} %")
    if old.live_decode_p50_ms > 0 and new.live_decode_p50_ms > 0:
        live = relative_change(old.live_decode_p50_ms, new.live_decode_p50_ms)
        if live >= th.max_latency_regression:
            fail("latency", f"live decode p50 +{100 * live:.1f} % >= {100 * th.max_latency_regression:.0f} %")
    mem = abs(relative_change(old.kv_tokens, new.kv_tokens))
    if mem >= th.max_memory_diff:
        fail("memory", f"KV pool differs by {100 * mem:.1f} % >= {100 * th.max_memory_diff:.0f} %")
    rate_old = old.probe_errors / old.probes if old.probes else 0.0
    rate_new = new.probe_errors / new.probes if new.probes else 0.0
    if rate_new - rate_old > th.max_error_rate_increase:
        fail("errors", f"probe error rate {rate_new:.3f} vs {rate_old:.3f} for the old version")
    if new.live_error_rate - old.live_error_rate > th.max_error_rate_increase:
        fail("errors", f"live error rate {new.live_error_rate:.3f} vs {old.live_error_rate:.3f}")
    return Verdict(not failed, tuple(failed), tuple(reasons), cons, lat, mem)


def probe_prompts(count: int, length: int, vocab: int = 1000, seed: int = 0) -> list[list[int]]:
    """The fixed probe set: `count` prompts of `length` token ids in [3, vocab), a function of `seed` only
    (a 64-bit LCG), so every check and every version sees the same prompts."""
    if count < 1 or length < 1:
        raise InvalidArgument("probe_prompts", f"need count >= 1 and length >= 1, got {count}, {length}")
    x = (seed * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
    out: list[list[int]] = []
    for _ in range(count):
        prompt = []
        for _ in range(length):
            x = (x * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
            prompt.append(3 + (x >> 33) % (vocab - 3))
        out.append(prompt)
    return out
