"""cost: (alpha·P + (1-alpha)·D) / S on one shared scale S = max(max P, max D)."""

import pytest

from kvmesh.routing.scorers import CostScorer
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit


def test_formula_on_shared_scale() -> None:
    req = RoutingQuery("r", prompt_tokens=1000, block_size=100, matches={"hot": 9})
    hot = WorkerView("hot", decode_tokens_active=2000)  # P = 100, D = 2000
    cold = WorkerView("cold", decode_tokens_active=0)  # P = 1000, D = 0
    s = CostScorer(prefill_weight=0.5, decode_weight=0.5)
    # S = 2000
    assert s.score(req, [hot, cold], [hot, cold]) == pytest.approx([(50 + 1000) / 2000, 500 / 2000])
    s.set_weights(0.9, 0.1)
    assert s.alpha == pytest.approx(0.9)
    assert s.score(req, [hot, cold], [hot, cold]) == pytest.approx([(90 + 200) / 2000, 900 / 2000])


def test_bad_weights_rejected_and_unchanged() -> None:
    s = CostScorer(0.7, 0.3)
    with pytest.raises(ValueError):
        s.set_weights(0, 0)
    with pytest.raises(ValueError):
        s.set_weights(-1, 1)
    assert s.alpha == pytest.approx(0.7)


def test_cached_worker_loses_after_bounded_extra_load() -> None:
    # With alpha = 0.9 the cached worker keeps winning only while 0.1·D < 0.9·(prompt it saves):
    # fewer than ~9 prompts' worth of decode KV, then the cold worker is cheaper.
    s = CostScorer(0.9, 0.1)
    req = RoutingQuery("r", prompt_tokens=1024, block_size=16, matches={"hot": 64})
    wins = 0
    hot, cold = WorkerView("hot"), WorkerView("cold")
    for _ in range(50):
        c = s.score(req, [hot, cold], [hot, cold])
        if c[0] >= c[1]:
            break
        wins += 1
        hot.inflight_decode_tokens += 1024
    assert 8 <= wins <= 10


def test_itl_term_sends_short_outputs_away_from_queued_prefill() -> None:
    # "hot" caches 900 of 1000 prompt tokens but is prefilling 20 000 tokens of other prompts.
    hot = WorkerView("hot", prefill_tokens_queued=20_000)
    cold = WorkerView("cold")
    s = CostScorer(prefill_weight=0.9, decode_weight=0.1, itl_weight=10, prefill_slots=8)
    long_out = RoutingQuery("a", prompt_tokens=1000, block_size=100, matches={"hot": 9}, max_tokens=10_000)
    short_out = RoutingQuery("b", prompt_tokens=1000, block_size=100, matches={"hot": 9}, max_tokens=4)
    # T(hot) = 100 + min(20000, 8·100) = 900, T(cold) = 1000; I(hot) = 10·19900/(out − 1), I(cold) = 0
    # long output: 0.9·900 + 19.9 ≈ 830 < 0.9·1000 = 900 → hot;  short: 0.9·900 + 66 333 → cold
    c_long = s.score(long_out, [hot, cold], [hot, cold])
    c_short = s.score(short_out, [hot, cold], [hot, cold])
    assert c_long[0] < c_long[1]
    assert c_short[1] < c_short[0]
    assert c_short == pytest.approx([(810 + 199_000 / 3) / (199_000 / 3), 900 / (199_000 / 3)])


def test_prefill_slots_keep_a_cache_hit_on_a_busy_worker() -> None:
    # Chunked prefill: 100 new tokens behind a 20 000-token queue wait for ≤ k·100 of it, not all of it.
    req = RoutingQuery("r", prompt_tokens=1000, block_size=100, matches={"hot": 9}, max_tokens=100_000)
    hot = WorkerView("hot", prefill_tokens_queued=20_000)
    cold = WorkerView("cold")
    fifo = CostScorer(1.0, 0.0)  # k = 0: the whole queue counts
    chunked = CostScorer(1.0, 0.0, prefill_slots=8)
    assert fifo.score(req, [hot, cold], [hot, cold]) == pytest.approx([1.0, 1000 / 20_100])
    assert chunked.score(req, [hot, cold], [hot, cold]) == pytest.approx([900 / 1000, 1.0])


def test_bad_itl_weight_and_slots_rejected() -> None:
    with pytest.raises(ValueError):
        CostScorer(itl_weight=-1)
    with pytest.raises(ValueError):
        CostScorer(prefill_slots=-1)


def test_interference_term_keeps_cold_prompts_off_busy_workers() -> None:
    # A cold 8 000-token prompt: E = n · running, so the worker running 3 sequences costs 0.25·8000·3 more.
    req = RoutingQuery("r", prompt_tokens=8000, block_size=100, max_tokens=200)
    busy = WorkerView("busy", running=3, decode_tokens_active=300)
    idle = WorkerView("idle", running=0, decode_tokens_active=0)
    s = CostScorer(0.9, 0.1, interference_weight=0.25)
    # S = max(T = 8000, X = 6000, D = 300) = 8000
    assert s.score(req, [busy, idle], [busy, idle]) == pytest.approx(
        [(0.9 * 8000 + 0.25 * 8000 * 3 + 0.1 * 300) / 8000, 0.9]
    )
    # a full cache hit prefills (almost) nothing, so the busy worker's sequences are not delayed
    hit = RoutingQuery("h", prompt_tokens=8000, block_size=100, matches={"busy": 80}, max_tokens=200)
    c = s.score(hit, [busy, idle], [busy, idle])
    assert c[0] < c[1]
    with pytest.raises(ValueError):
        CostScorer(interference_weight=-0.1)


def test_interference_term_takes_off_the_requests_that_ended_since_the_report() -> None:
    # "stale" reported 4 running, but 3 of this router's requests there have ended since: R = max(4 - 3, 1)
    req = RoutingQuery("r", prompt_tokens=512, block_size=32, max_tokens=16)
    stale = WorkerView("stale", running=4, ended_requests=3, inflight_requests=1)
    busy = WorkerView("busy", running=4, inflight_requests=4)
    s = CostScorer(0.9, 0.1, interference_weight=0.25)
    # S = max(T = 512, X = 0.25·512·4 = 512, D = 0) = 512
    assert s.score(req, [stale, busy], [stale, busy]) == pytest.approx(
        [(0.9 * 512 + 0.25 * 512 * 1) / 512, (0.9 * 512 + 0.25 * 512 * 4) / 512]
    )
    # never below this router's own requests there
    own = WorkerView("own", running=4, ended_requests=4, inflight_requests=2)
    assert s.score(req, [own], [own]) == pytest.approx([(0.9 * 512 + 0.25 * 512 * 2) / 512])


def test_interference_floor_leaves_one_step_s_prefill_uncharged() -> None:
    # E = R · max(n − f, 0): a cold 1 000-token prompt under f = 8192 charges nothing for the running
    # sequences (their queued prefill decides), a 10 000-token one charges the 1 808 tokens beyond it.
    queued = WorkerView("queued", running=0, prefill_tokens_queued=4000)
    running = WorkerView("running", running=20)
    s = CostScorer(0.9, 0.1, prefill_slots=8, interference_weight=0.25, interference_floor=8192)
    short = RoutingQuery("s", prompt_tokens=1000, block_size=100, max_tokens=200)
    assert s.score(short, [queued, running], [queued, running]) == pytest.approx([0.9, 0.9 * 1000 / 5000])
    unfloored = CostScorer(0.9, 0.1, prefill_slots=8, interference_weight=0.25)
    c = unfloored.score(short, [queued, running], [queued, running])
    assert c[1] > c[0]  # without the floor the running count outweighs 4 000 queued prefill tokens
    long = RoutingQuery("l", prompt_tokens=10_000, block_size=100, max_tokens=200)
    x = 0.25 * 20 * (10_000 - 8192)
    t_q = 10_000 + 4000
    assert s.score(long, [queued, running], [queued, running]) == pytest.approx(
        [0.9 * t_q / t_q, (0.9 * 10_000 + x) / t_q]
    )
    with pytest.raises(ValueError):
        CostScorer(interference_floor=-1)
