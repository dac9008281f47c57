"""A 100 %-shared system prompt must spread over all workers (simulated decisions, in-flight accounting).

Every request is a 2048-token shared system prompt plus 64 unique tokens; a worker that served it once holds
the prefix (the index reports 128 matched blocks). Requests get their first token 4 decisions later and end
when more than 64 are outstanding (FIFO), so the router only knows the load through its own accounting.
"""

import collections
from collections.abc import Sequence

import pytest

from kvmesh.routing import InflightTracker, Profile, RoutingQuery, WorkerView
from kvmesh.routing.pickers import MinCostPicker

pytestmark = pytest.mark.unit
N_WORKERS, SHARED, UNIQUE, BS = 8, 2048, 64, 16


def simulate(
    profiles: list[Profile], n_requests: int, report_every: int = 0, scale: bool = True
) -> tuple[collections.Counter[str], int]:
    """Route `n_requests` round-robin over router replicas; returns (per-worker counts, max in-flight spread)."""
    trackers = [InflightTracker(replicas=len(profiles) if scale else 1) for _ in profiles]
    views = [[WorkerView(f"w{i}", kv_blocks_total=1_000_000) for i in range(N_WORKERS)] for _ in profiles]
    cached: set[str] = set()
    outstanding: collections.deque[tuple[int, str, str]] = collections.deque()
    counts: collections.Counter[str] = collections.Counter()
    truth: collections.Counter[str] = collections.Counter()  # tokens really on each worker
    spread = 0
    for i in range(n_requests):
        now = i * 0.01
        r = i % len(profiles)
        rid = f"req-{i}"
        req = RoutingQuery(
            rid, SHARED + UNIQUE, block_size=BS, matches={w: SHARED // BS for w in cached}, max_tokens=128
        )
        trackers[r].apply(views[r])
        d = profiles[r].decide(req, views[r])
        assert d.worker_id is not None
        w = d.worker_id
        trackers[r].assign(rid, w, req.prompt_tokens - req.overlap_tokens(w), req.prompt_tokens, BS, now)
        cached.add(w)
        counts[w] += 1
        truth[w] += req.prompt_tokens
        outstanding.append((r, rid, w))
        if len(outstanding) > 4:
            rr, rid4, _ = outstanding[-5]
            trackers[rr].first_token(rid4)
        if len(outstanding) > 64:
            rr, old, ow = outstanding.popleft()
            trackers[rr].finish(old)
            truth[ow] -= SHARED + UNIQUE
        if report_every and i % report_every == 0:  # every replica sees the same true load
            for rr, vs in enumerate(views):
                for v in vs:
                    v.decode_tokens_active = truth[v.id]
                    trackers[rr].on_report(v.id, now)
        per_worker = [truth[f"w{k}"] // (SHARED + UNIQUE) for k in range(N_WORKERS)]
        if i > 100:
            spread = max(spread, max(per_worker) - min(per_worker))
    return counts, spread


def balance(counts: collections.Counter[str]) -> float:
    return max(counts.values()) / (sum(counts.values()) / N_WORKERS)


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.9])
def test_shared_prompt_spreads_over_all_workers(alpha: float) -> None:
    p = Profile.default(seed=11)
    p.set_weights(prefill_weight=alpha, decode_weight=1 - alpha)
    counts, spread = simulate([p], 800)
    assert len(counts) == N_WORKERS
    assert balance(counts) < 1.15
    assert spread <= 4  # in-flight requests per worker never differ by more than 4 (of 64 over 8 workers)


def test_three_router_replicas_do_not_pile_onto_one_worker() -> None:
    # Replicas see each other only through load reports (every 25 decisions); each scales its own
    # unreported work by the replica count, and the min-cost picker draws its tie-break at random.
    counts, spread = simulate([Profile.default(seed=s) for s in (1, 2, 3)], 900, report_every=25)
    assert len(counts) == N_WORKERS
    assert balance(counts) < 1.1
    assert spread <= 10
    _, unscaled = simulate([Profile.default(seed=s) for s in (1, 2, 3)], 900, report_every=25, scale=False)
    assert unscaled > spread  # the replica scaling is what keeps them apart between reports


class OverlapOnly:
    """Control: cost = 1 - overlap/prompt, what a load-blind cache-aware router does."""

    name = "overlap-only"

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        return [1.0 - req.overlap_tokens(w.id) / req.prompt_tokens for w in candidates]


def test_the_metric_can_fail_overlap_only_routing_herds() -> None:
    herd = Profile([], [(OverlapOnly(), 1.0)], MinCostPicker(epsilon=0.0, seed=0))
    counts, spread = simulate([herd], 400)
    assert max(counts.values()) > 0.95 * 400
    assert spread > 50
