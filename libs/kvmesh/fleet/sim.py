"""Discrete-event fleet simulator: N simulated engines, a simulated cache-manager index, one policy.

Virtual clock, one heap of events ``(time, order, seq, kind, arg)``:

* ARRIVAL(i): request i (arrival time ÷ ``load_scale``, or ``think_s`` after the request it follows
  completes) is hashed, matched against the index (``find_matches``), routed by the policy over one
  ``WorkerView`` per worker (the engine's ``load_report`` at that instant) and queued on the chosen
  ``SimEngineCore``; an idle engine starts a step at once.
* STEP_END(w): the iteration that engine w started ``duration_s`` earlier completes: its KV events are
  applied to the index (``BlockStored`` → ``store``, ``BlockRemoved`` → ``remove``, ``AllBlocksCleared`` →
  ``clear``), its outputs timestamp first tokens and completions, and the engine starts its next step if it
  has work.

The index is fed the engines' hashes: the simulated engine hashes tokens with ``kvmesh.index.hashing`` and the
same salt as the requests, so they equal the index hashes the cache-manager derives from token ids (a unit
test checks this). Nothing reads a wall clock; the same seed gives the same run. Loops are bounded by
``max_events`` and, optionally, ``max_wall_s`` (a run cut short is flagged ``truncated``).
With a KV data plane (``FleetConfig.data_plane``, :mod:`kvmesh.fleet.tiers`) every worker also has a CPU tier
(and optionally a disk tier) that keeps the blocks its GPU pool evicts. At its arrival a request routed to
worker w is given, beyond w's GPU hit, the following blocks of its prefix that w's tiers hold (a host→GPU copy
over PCIe, or a disk read), then — for a policy with ``peer_pulls`` (kvmesh), when it beats recomputing with
the margin (``kvmesh.routing.dataplane.pull_pays``) — the blocks the best peer holds in its GPU or tiers (bytes
over the inter-node network into w's host memory plus a round trip, then host→GPU over PCIe). Links are FIFO
per worker (PCIe in, NIC in, NIC out, disk), so transfers queue behind each other. Blocks already on their
way to w are not fetched twice: a second request for them waits for the same transfer (in-flight dedup).
When its transfers are done (event READY) the blocks enter w's pool as cached and the request is queued on
w; the engine then counts them as cached tokens,
so ``hit_ratio`` = prompt tokens not recomputed (GPU hits + tier loads + pulls).
With a batching window (``FleetConfig.batching``, :mod:`kvmesh.fleet.batching`) a request routed to w waits in
w's window and is queued on the engine when a release (event WINDOW) lets it through, shortest prompt first.
With P/D disaggregation (``FleetConfig.pd``, :mod:`kvmesh.fleet.pd`) the first x slots are prefill-only
engines and the others decode engines; per request the policy's decider says aggregated (the policy routes
over the decode pool) or a (prefill, decode) pair: the prefill half runs on the prefill worker (with its tier
loads and pulls as above), its KV crosses the NICs (FIFO, event HANDOFF) and the decode half runs on the
decode worker. The summary's ``pd`` block counts the decisions and the handoff times.
With ``stop_when_slo_lost`` a run stops as soon as more requests violated TTFT (or ITL) than the p99 allows
(``> n − ⌈0.99 n⌉``): the SLO verdict is then certain (used by the capacity bisection).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from kvmesh.core.errors import InvalidArgument, ResourceExhausted
from kvmesh.core.generation import EngineRequest, SamplingParams
from kvmesh.core.handoff import KvHandoff, WorkerRole
from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvmesh.engine.batching import WindowConfig
from kvmesh.engine.sim.core import SimConfig, SimEngineCore
from kvmesh.engine.sim.perf import block_bytes, chunked_prefill_time
from kvmesh.fleet.batching import FleetWindows
from kvmesh.fleet.metrics import RequestRecord, Slo, pct, summarize
from kvmesh.fleet.pd import Decider, HandoffEngineCore, PdFleet, make_decider
from kvmesh.fleet.policies.base import Policy
from kvmesh.fleet.tiers import DataPlane, WorkerTiers
from kvmesh.fleet.trace import DEFAULT_VOCAB, Trace, prompt_tokens
from kvmesh.index.hashing import compute_block_hashes
from kvmesh.routing.dataplane import load_pays, pull_pays
from kvmesh.routing.types import RoutingQuery, WorkerView

_PREFILL_HALF = "pf-"  # request id prefix of a disaggregated request's prefill half

_STEP_END, _ARRIVAL, _WARM, _READY, _WINDOW, _CALL, _HANDOFF = 0, 1, 2, 3, 4, 5, 6


class Index(Protocol):
    def store(self, worker: str, parent: int | None, hashes: Sequence[int]) -> Any: ...
    def remove(self, worker: str, hashes: Sequence[int]) -> Any: ...
    def clear(self, worker: str) -> Any: ...
    def find_matches(self, hashes: Sequence[int] | np.ndarray) -> dict[str, int]: ...


def default_index() -> Index:
    from kvmesh.index import PrefixIndex

    idx: Index = PrefixIndex()
    return idx


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """A simulated fleet. ``num_blocks=None`` sizes each worker's KV pool from the perf model."""

    workers: int = 16
    block_size: int = 512
    num_blocks: int | None = None
    prefill_chunk_tokens: int = 1024
    max_batched_tokens: int = 8192
    load_scale: float = 1.0
    seed: int = 0
    slo: Slo = Slo()
    stop_when_slo_lost: bool = False
    util_bucket_s: float = 60.0
    gpu_hour_price: float = 3.5
    max_events: int = 200_000_000
    max_wall_s: float | None = None
    vocab_size: int = DEFAULT_VOCAB
    data_plane: DataPlane | None = None
    batching: WindowConfig | None = None  # a batching window at each worker's admission (kvmesh.fleet.batching)
    pd: PdFleet | None = None  # prefill/decode pools and the decider (kvmesh.fleet.pd)
    # the TTFT allowance's chunk (ttft_mode "excess"); None: prefill_chunk_tokens. A chunk search fixes it so
    # that every candidate is judged against the same allowance.
    allowance_chunk_tokens: int | None = None

    def gpu_blocks_per_worker(self) -> int:
        """KV blocks of one worker's engine pool."""
        return self.engine_config().resolved_num_blocks()

    def fleet_capacity_blocks(self) -> int:
        """Blocks the whole fleet can hold: workers · (GPU pool + CPU tier + disk tier)."""
        per = self.gpu_blocks_per_worker()
        if self.data_plane is not None:
            spec = self.data_plane.spec(self.block_size)
            per += spec.cpu_blocks + spec.disk_blocks
        return self.workers * per

    def engine_config(self) -> SimConfig:
        return SimConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            max_batched_tokens=self.max_batched_tokens,
            vocab_size=self.vocab_size,
            check_token_range=False,  # `check_tokens` checks each prompt once, vectorised
        )

    def role(self, slot: int) -> WorkerRole:
        """Worker ``slot``'s role: the first ``pd.prefill_workers`` slots prefill, the rest decode."""
        if self.pd is None:
            return WorkerRole.BOTH
        return WorkerRole.PREFILL if slot < self.pd.prefill_workers else WorkerRole.DECODE

    def engine_for(self, slot: int) -> SimEngineCore:
        """A fresh engine for worker ``slot`` (a prefill engine runs the P/D prefill budget and chunk)."""
        ecfg = self.engine_config()
        w = f"w{slot:02d}"
        if self.pd is None:
            return SimEngineCore(ecfg, worker_id=w)
        if self.role(slot) is WorkerRole.PREFILL:
            pre = replace(
                ecfg,
                max_batched_tokens=self.pd.prefill_max_batched_tokens,
                prefill_chunk_tokens=min(self.pd.prefill_chunk_tokens, self.pd.prefill_max_batched_tokens),
            )
            return SimEngineCore(pre, worker_id=w)
        return HandoffEngineCore(ecfg, worker_id=w)


def check_tokens(tokens: np.ndarray, vocab_size: int) -> None:
    """Raise InvalidArgument unless every token id is in [0, vocab_size) (one vectorised min/max)."""
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise InvalidArgument("prompt_token_ids", f"token ids must be in [0, {vocab_size})")


class HashCache:
    """Full-block hashes of every request of a trace at one block size (computed once, reused by runs)."""

    def __init__(self, trace: Trace, block_size: int, vocab_size: int = DEFAULT_VOCAB) -> None:
        self.trace = trace
        self.block_size = block_size
        self.vocab_size = vocab_size
        self._h: list[np.ndarray | None] = [None] * len(trace)
        self._iso: dict[tuple[int, int], float] = {}

    def tokens(self, i: int) -> np.ndarray:
        return prompt_tokens(self.trace.requests[i], self.vocab_size)

    def isolated_ttft(self, i: int, chunk: int) -> float:
        """Prefill time of request i alone on an idle engine with an empty cache (perf model)."""
        t = self._iso.get((i, chunk))
        if t is None:
            t = self._iso[(i, chunk)] = chunked_prefill_time(self.trace.requests[i].input_len, 0, chunk)
        return t

    def hashes(self, i: int, tokens: np.ndarray | None = None) -> np.ndarray:
        h = self._h[i]
        if h is None:
            toks = self.tokens(i) if tokens is None else tokens
            h = self._h[i] = compute_block_hashes(toks, self.block_size)
        return h


@dataclass(slots=True)
class RunResult:
    """Everything one run measured."""

    policy: str
    config: FleetConfig
    records: list[RequestRecord]
    busy_s: dict[str, float]
    util_series: dict[str, list[float]]  # compute utilisation per worker per util_bucket_s
    rejected: int = 0
    stopped_early: bool = False
    truncated: bool = False
    events: int = 0
    wall_s: float = 0.0
    warm_requests: int = 0
    summary: dict[str, Any] = field(default_factory=dict)


class FleetWarmer(Protocol):
    """Optional warming strategy: asked at start and after every arrival for prefill-only requests."""

    def start(self, sim: FleetSim, now: float) -> None: ...
    def on_arrival(self, sim: FleetSim, hashes: np.ndarray, tokens: np.ndarray, now: float) -> None: ...


class FleetSim:
    """One run of ``trace`` under ``policy`` on the fleet described by ``config``."""

    def __init__(
        self,
        trace: Trace,
        policy: Policy,
        config: FleetConfig = FleetConfig(),
        hashes: HashCache | None = None,
        index_factory: Callable[[], Index] = default_index,
        warmer: FleetWarmer | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.trace = trace
        self.policy = policy
        self.cfg = config
        self.hc = hashes if hashes is not None else HashCache(trace, config.block_size, config.vocab_size)
        if self.hc.block_size != config.block_size:
            raise ValueError("hash cache block size differs from the fleet's")
        self.index = index_factory()
        self.warmer = warmer
        self.progress = progress
        ecfg = config.engine_config()
        if config.pd is not None:
            config.pd.check(config.workers)
        self.ids = [f"w{i:02d}" for i in range(config.workers)]
        self.engines = [config.engine_for(i) for i in range(config.workers)]
        self.roles = [config.role(i) for i in range(config.workers)]
        self.slot = {w: i for i, w in enumerate(self.ids)}
        self._views: list[WorkerView | None] = [None] * config.workers
        self.serving = [True] * config.workers  # routable workers (an autoscaler turns slots off and on)
        self._awaiting = [0] * config.workers  # routed requests waiting for their transfers (_READY)
        self._busy = [False] * config.workers
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.records: list[RequestRecord | None] = [None] * len(trace)
        self._children: dict[int, list[int]] = {}
        for r in trace.requests:
            if r.follows is not None:
                self._children.setdefault(r.follows, []).append(r.index)
        self.busy_s = dict.fromkeys(self.ids, 0.0)
        self.work_s = dict.fromkeys(self.ids, 0.0)
        perf = ecfg.perf
        self._s_per_token = 2.0 * perf.n_params / perf.effective_flops
        self.util: dict[str, list[float]] = {w: [] for w in self.ids}
        self.rejected = 0
        self.warm_requests = 0
        self._warm_seq = 0
        self._ttft_bad = 0
        self._itl_bad = 0
        n = len(trace)
        self._allowed_bad = n - math.ceil(0.99 * n)
        self._init_data_plane()
        self._init_pd()
        self.windows = FleetWindows(config.batching, config.workers) if config.batching is not None else None

    def _init_data_plane(self) -> None:
        dp = self.cfg.data_plane
        n = self.cfg.workers
        self.dp = dp
        self.pulls = dp is not None and self.policy.peer_pulls
        self.tiers: list[WorkerTiers] = []
        self.gpu_held: list[set[int]] = [set() for _ in range(n)]  # what the index says each GPU pool holds
        self._incoming: list[dict[int, float]] = [{} for _ in range(n)]  # block → arrival time of its transfer
        self._link_free: dict[tuple[str, int], float] = {}
        self.dp_stats: dict[str, float] = dict.fromkeys(
            ("loaded_cpu_blocks", "loaded_disk_blocks", "pulled_blocks", "pull_bytes", "pulls", "deduped_blocks",
             "pulls_refused", "tier_saved_blocks", "tier_dropped_blocks", "delayed_requests"),
            0,
        )  # fmt: skip
        if dp is None:
            self.transfer_costs = None
            return
        spec = dp.spec(self.cfg.block_size)
        self.tiers = [WorkerTiers(spec) for _ in range(n)]
        self.transfer_costs = dp.transfer_costs(self.cfg.block_size)
        self._block_bytes = block_bytes(self.cfg.block_size)
        self._loads_pay = load_pays(1, self.cfg.block_size, self.transfer_costs)

    def _init_pd(self) -> None:
        pd = self.cfg.pd
        self.decider: Decider | None = make_decider(pd.decider) if pd is not None else None
        self._kv_tok = self.cfg.engine_config().perf.kv_bytes_per_token
        self._pd_half: dict[int, tuple[int, RoutingQuery]] = {}  # request → (decode slot, its query), until handed
        self._pd_cached: dict[int, int] = {}  # request → prompt tokens the prefill worker found cached
        self._handoff_s: list[float] = []
        self.pd_stats: dict[str, float] = dict.fromkeys(("disaggregated", "aggregated", "fallbacks"), 0)
        self.pd_reasons: dict[str, int] = {}

    # ---------------------------------------------------------------- scheduling helpers
    def _push(self, t: float, kind: int, arg: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, kind, arg))

    def view(self, slot: int) -> WorkerView:
        v = self._views[slot]
        if v is None:
            v = WorkerView(id=self.ids[slot], transfer=self.transfer_costs, role=self.roles[slot])
            v.apply_report(self.engines[slot].load_report(self.now))
            self._views[slot] = v
        return v

    def views(self) -> list[WorkerView]:
        return [self.view(i) for i in range(len(self.ids)) if self.serving[i]]

    def at(self, t: float, call: Callable[[], None]) -> None:
        """Run ``call`` at simulated time ``t`` (hooks such as an autoscaler's ticks)."""
        self._push(t, _CALL, call)

    def pending_events(self) -> int:
        """Events still queued (a periodic hook stops rescheduling itself when nothing else is)."""
        return len(self._heap)

    def idle(self, slot: int) -> bool:
        """Worker ``slot`` has nothing queued, running or in a step."""
        held = self.windows is not None and len(self.windows.windows[slot]) > 0  # in its batching window
        return not self._busy[slot] and not self._awaiting[slot] and not held and not self.engines[slot].has_work()

    def reset_worker(self, slot: int) -> None:
        """Worker ``slot`` leaves the fleet: its engine, index entries, tiers and transfers are gone, so it
        comes back cold. Only for an idle worker (nothing queued or running)."""
        if not self.idle(slot):
            raise RuntimeError(f"worker {self.ids[slot]} still has work")
        w = self.ids[slot]
        self.engines[slot] = self.cfg.engine_for(slot)
        self.index.clear(w)
        self.gpu_held[slot].clear()
        self._incoming[slot].clear()
        if self.dp is not None:
            self.tiers[slot] = WorkerTiers(self.dp.spec(self.cfg.block_size))
        self._views[slot] = None

    def _kick(self, slot: int) -> None:
        """Start a step on an idle engine that has work."""
        if self._busy[slot] or not self.engines[slot].has_work():
            return
        res = self.engines[slot].step(self.now)
        self._views[slot] = None
        self._busy[slot] = True
        w = self.ids[slot]
        self.busy_s[w] += res.duration_s
        work = (res.prefill_tokens + res.decode_tokens) * self._s_per_token
        self.work_s[w] += work
        b = int(self.now // self.cfg.util_bucket_s)
        series = self.util[w]
        while len(series) <= b:
            series.append(0.0)
        series[b] += work
        self._push(self.now + res.duration_s, _STEP_END, (slot, res))

    def hc_hashes_of(self, tokens: np.ndarray) -> np.ndarray:
        """Full-block hashes of arbitrary tokens at the fleet's block size."""
        return compute_block_hashes(tokens, self.cfg.block_size)

    def submit_warm(self, slot: int, tokens: np.ndarray) -> bool:
        """Queue a prefill-only request (warming) on worker ``slot``; False if the engine refuses it."""
        self._warm_seq += 1
        check_tokens(tokens, self.cfg.vocab_size)
        req = EngineRequest(
            f"warm-{self._warm_seq}",
            prompt_token_ids=tuple(tokens.tolist()),
            sampling=SamplingParams(max_tokens=1, seed=self._warm_seq),
            prefill_only=True,
        )
        try:
            self.engines[slot].add_request(req, self.now)
        except (ResourceExhausted, InvalidArgument):
            return False
        self.warm_requests += 1
        self._views[slot] = None
        self._kick(slot)
        return True

    # ---------------------------------------------------------------- event handlers
    def _arrival(self, i: int) -> None:
        r = self.trace.requests[i]
        toks = self.hc.tokens(i)
        check_tokens(toks, self.cfg.vocab_size)
        hs = self.hc.hashes(i, toks)
        hl = hs.tolist()
        matches = self.index.find_matches(hs) if hl else {}
        tier_matches = self._tier_matches(hl) if self.pulls and hl else {}
        rr = RoutingQuery(
            request_id=str(i),
            prompt_tokens=r.input_len,
            block_hashes=hl,
            matches=matches,
            block_size=self.cfg.block_size,
            session_id=r.session or "",
            max_tokens=r.output_len,
            tier_matches=tier_matches,
            peer_pulls=self.pulls,
        )
        if self.decider is None:
            wid = self.policy.choose(rr, self.views(), self.now)
        else:
            wid, rr = self._pd_route(i, rr)
        slot = self.slot[wid]
        rec = RequestRecord(i, wid, self.now, r.input_len, r.output_len)
        if self.cfg.slo.ttft_mode == "excess":
            rec.ttft_allow = self.hc.isolated_ttft(i, self.cfg.allowance_chunk_tokens or self.cfg.prefill_chunk_tokens)
        self.records[i] = rec
        fetch = self._fetch(slot, i, hl, tier_matches) if self.dp is not None and hl else None
        if fetch is not None and fetch[0] > self.now:  # wait for the transfers, then queue on the engine
            self.policy.on_routed(rr, wid, self.now)
            self.dp_stats["delayed_requests"] += 1
            self._awaiting[slot] += 1
            self._push(fetch[0], _READY, (slot, i, fetch[1]))
        else:
            if fetch is not None:
                self._insert_blocks(slot, i, fetch[1])
            self._submit(slot, i, rr)
        if self.warmer is not None:
            self.warmer.on_arrival(self, hs, toks, self.now)

    def _pd_route(self, i: int, rr: RoutingQuery) -> tuple[str, RoutingQuery]:
        """The decider's answer for request i: (the worker it goes to first, the query its policy is told).
        Disaggregated: the prefill worker, with the query of the prefill half (id ``pf-i``, one token); the
        decode half's query is kept for the handoff."""
        assert self.decider is not None
        views = self.views()
        c = self.decider.choose(rr, views, self.policy, self.now)
        st = self.pd_stats
        self.pd_reasons[c.reason] = self.pd_reasons.get(c.reason, 0) + 1
        if not c.disaggregate or c.prefill is None or c.decode is None:
            st["aggregated"] += 1
            st["fallbacks"] += int(c.fallback)
            decode = [v for v in views if v.role.decodes]
            return (c.decode if c.decode is not None else self.policy.choose(rr, decode, self.now)), rr
        st["disaggregated"] += 1
        full = len(rr.block_hashes)
        # the decode half finds the whole prompt there: its policy books no prefill for it
        self._pd_half[i] = (self.slot[c.decode], replace(rr, matches={c.decode: full}, tier_matches={}))
        return c.prefill, replace(rr, request_id=f"{_PREFILL_HALF}{i}", max_tokens=1)

    def _handoff(self, p_slot: int, i: int) -> None:
        """Request i's prefill half ended on ``p_slot``: move its KV to the decode worker over the NICs."""
        pd = self.cfg.pd
        assert pd is not None
        d_slot, _ = self._pd_half[i]
        bs = self.cfg.block_size
        n = self.trace.requests[i].input_len
        held = len(self.engines[d_slot].pool.match_prefix(self.hc.hashes(i).tolist()[: (n - 1) // bs]))
        secs = pd.handoff_s(n - 1 - held * bs, self._kv_tok)
        end = self._transfer(("nic_in", d_slot), secs, ("nic_out", p_slot)) if secs > 0 else self.now
        self._handoff_s.append(end - self.now)
        self._awaiting[d_slot] += 1
        self._push(end, _HANDOFF, i)

    def _handed(self, i: int) -> None:
        d_slot, rr = self._pd_half.pop(i)
        self._awaiting[d_slot] -= 1
        self._submit(d_slot, i, rr)

    def _submit(self, slot: int, i: int, rr: RoutingQuery | None) -> None:
        """Queue request i on engine ``slot``, through its batching window when there is one."""
        if self.windows is not None:
            self.windows.hold(self, slot, i, rr)
        else:
            self.enter(slot, i, rr)

    def push_window(self, t: float, slot: int) -> None:
        """Schedule the release of worker ``slot``'s batching window at ``t``."""
        self._push(t, _WINDOW, slot)

    def reject(self, slot: int, rid: str, told: bool) -> None:
        """Request ``rid`` is refused at worker ``slot`` (never served: an SLO violation, first_token stays NaN);
        ``told``: the policy had been told it was routed there."""
        self.rejected += 1
        self._ttft_bad += 1
        self._itl_bad += 1
        if told:
            self.policy.on_finish(rid, self.ids[slot], self.now)

    def enter(self, slot: int, i: int, rr: RoutingQuery | None) -> None:
        """Queue request i on engine ``slot``; ``rr`` None: the policy was told at routing time (data plane,
        batching window)."""
        r = self.trace.requests[i]
        rid = str(i)
        toks = tuple(self.hc.tokens(i).tolist())
        if i in self._pd_half and self.roles[slot] is WorkerRole.PREFILL:  # the prefill half
            rid = f"{_PREFILL_HALF}{i}"
            req = EngineRequest(
                rid, prompt_token_ids=toks, sampling=SamplingParams(max_tokens=1, seed=i), prefill_only=True
            )
        else:
            handoff = None
            if i in self._pd_cached:  # the decode half: its KV was handed over
                handoff = KvHandoff(
                    num_blocks=(r.input_len - 1) // self.cfg.block_size, cached_tokens=self._pd_cached[i]
                )
            req = EngineRequest(
                rid,
                prompt_token_ids=toks,
                sampling=SamplingParams(max_tokens=r.output_len, ignore_eos=True, seed=i),
                handoff=handoff,
            )
        try:
            self.engines[slot].add_request(req, self.now)
        except (ResourceExhausted, InvalidArgument):
            self.reject(slot, rid, told=rr is None)
            return
        if rr is not None:
            self.policy.on_routed(rr, self.ids[slot], self.now)
        self._views[slot] = None
        self._kick(slot)

    # ---------------------------------------------------------------- data plane
    def _tier_matches(self, hl: Sequence[int]) -> dict[str, int]:
        """Per worker, the leading blocks of ``hl`` its GPU pool (as the index knows it) or tiers hold."""
        out: dict[str, int] = {}
        for v, w in enumerate(self.ids):
            held, tiers = self.gpu_held[v], self.tiers[v]
            k = 0
            for h in hl:
                if h not in held and h not in tiers:
                    break
                k += 1
            if k:
                out[w] = k
        return out

    def _transfer(
        self, link: tuple[str, int], seconds: float, also: tuple[str, int] | None = None, after: float = 0.0
    ) -> float:
        """Queue ``seconds`` of transfer on a FIFO link (and ``also``, a second one it occupies), starting no
        earlier than ``after``; its end time."""
        start = max(self.now, after, self._link_free.get(link, 0.0), self._link_free.get(also, 0.0) if also else 0.0)
        end = start + seconds
        self._link_free[link] = end
        if also is not None:
            self._link_free[also] = end
        return end

    def _fetch(
        self, slot: int, i: int, hl: Sequence[int], tier_matches: dict[str, int]
    ) -> tuple[float, list[tuple[int, int, int | None]]] | None:
        """Start the transfers that give worker ``slot`` the prefix of request i beyond its GPU hit (module
        docstring); returns (time they are all done, [(block index, hash, parent)]) or None if nothing moves."""
        dp, costs = self.dp, self.transfer_costs
        assert dp is not None and costs is not None
        bs = self.cfg.block_size
        hs = hl[: (self.trace.requests[i].input_len - 1) // bs]  # the engine always computes the last token
        j = len(self.engines[slot].pool.match_prefix(hs))
        if j >= len(hs):
            return None
        now, ready = self.now, self.now
        incoming, tiers, st = self._incoming[slot], self.tiers[slot], self.dp_stats
        take: list[tuple[int, int, int | None]] = []
        local: dict[str, list[int]] = {"cpu": [], "disk": []}
        while j < len(hs):
            h = hs[j]
            t = incoming.get(h)
            if t is not None:  # already on its way here: wait for that transfer, move nothing
                ready = max(ready, t)
                st["deduped_blocks"] += 1
            else:
                m = tiers.medium(h) if self._loads_pay else None
                if m is None:
                    break
                local[m].append(h)
                tiers.touch(h, now)
            take.append((j, h, hs[j - 1] if j else None))
            j += 1
        links = dp.links
        local_links = (("cpu", links.host_to_gpu_bytes_per_s, "pcie"), ("disk", links.disk_bytes_per_s, "disk"))
        for medium, bw, link in local_links:
            blocks = local[medium]
            if blocks:
                end = self._transfer((link, slot), len(blocks) * self._block_bytes / bw)
                ready = max(ready, end)
                incoming.update(dict.fromkeys(blocks, end))
                st[f"loaded_{medium}_blocks"] += len(blocks)
        if self.pulls and j < len(hs):
            src = max((v for v in tier_matches if v != self.ids[slot]), key=lambda v: tier_matches[v], default=None)
            k = min(tier_matches[src], len(hs)) - j if src is not None else 0
            if src is not None and k > 0:
                if pull_pays(k, bs, costs, dp.pull_margin):
                    s_slot = self.slot[src]
                    # peer → this host's memory over the network, then host → GPU over PCIe
                    net = self._transfer(
                        ("nic_in", slot), costs.pull_rtt_s + k * costs.block_pull_s, ("nic_out", s_slot)
                    )
                    end = self._transfer(("pcie", slot), k * costs.block_load_s, after=net)
                    ready = max(ready, end)
                    for jj in range(j, j + k):
                        incoming[hs[jj]] = end
                        self.tiers[s_slot].touch(hs[jj], now)
                        take.append((jj, hs[jj], hs[jj - 1] if jj else None))
                    st["pulls"] += 1
                    st["pulled_blocks"] += k
                    st["pull_bytes"] += k * self._block_bytes
                else:
                    st["pulls_refused"] += 1
        return (ready, take) if take else None

    def _insert_blocks(self, slot: int, i: int, take: Sequence[tuple[int, int, int | None]]) -> None:
        """The fetched blocks enter worker ``slot``'s pool as cached (chain order); their events are applied."""
        bs = self.cfg.block_size
        toks = self.hc.tokens(i)
        pool, incoming = self.engines[slot].pool, self._incoming[slot]
        for j, h, parent in take:
            if incoming.get(h, math.inf) <= self.now:
                del incoming[h]
            pool.insert_cached(h, parent, toks[j * bs : (j + 1) * bs].tolist(), j)
        ev = self.engines[slot].drain_events()
        if ev:
            self._apply_events(self.ids[slot], ev)
        self._views[slot] = None

    def _ready(self, slot: int, i: int, take: Sequence[tuple[int, int, int | None]]) -> None:
        self._awaiting[slot] -= 1
        self._insert_blocks(slot, i, take)
        self._submit(slot, i, None)

    def _apply_events(self, w: str, events: Sequence[KvEvent]) -> None:
        idx = self.index
        dp = self.dp is not None
        slot = self.slot[w]
        held = self.gpu_held[slot]
        for ev in events:
            if isinstance(ev, BlockStored):
                idx.store(w, ev.parent_block_hash, ev.block_hashes)
                if dp:
                    held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                idx.remove(w, ev.block_hashes)
                if dp:  # the GPU pool evicted them: they go to the worker's CPU tier
                    held.difference_update(ev.block_hashes)
                    tiers = self.tiers[slot]
                    before = tiers.dropped
                    tiers.save_evicted(ev.block_hashes, self.now)
                    self.dp_stats["tier_saved_blocks"] += len(ev.block_hashes)
                    self.dp_stats["tier_dropped_blocks"] += tiers.dropped - before
            elif isinstance(ev, AllBlocksCleared):
                idx.clear(w)
                held.clear()

    def _step_end(self, slot: int, res: Any) -> None:
        w = self.ids[slot]
        self._busy[slot] = False
        self._views[slot] = None
        if res.kv_events:
            self._apply_events(w, res.kv_events)
        slo = self.cfg.slo
        for out in res.outputs:
            rid = out.request_id
            if rid.startswith("warm-"):
                continue
            if rid.startswith(_PREFILL_HALF):
                if out.finished:
                    j = int(rid.removeprefix(_PREFILL_HALF))
                    self._pd_cached[j] = out.usage.cached_tokens if out.usage is not None else 0
                    self.policy.on_first_token(rid, w, self.now)
                    self.policy.on_finish(rid, w, self.now)
                    self._handoff(slot, j)
                continue
            rec = self.records[int(rid)]
            assert rec is not None
            if math.isnan(rec.first_token):
                rec.first_token = self.now
                self.policy.on_first_token(rid, w, self.now)
                if rec.ttft_over_allowance > slo.ttft_s:
                    self._ttft_bad += 1
            if out.finished:
                rec.finish = self.now
                if rec.index in self._pd_cached:  # disaggregated: the prefill worker's hit
                    rec.cached_tokens = self._pd_cached.pop(rec.index)
                elif out.usage is not None:
                    rec.cached_tokens = out.usage.cached_tokens
                self.policy.on_finish(rid, w, self.now)
                if rec.itl > slo.itl_s:
                    self._itl_bad += 1
                for c in self._children.get(rec.index, ()):
                    self._push(self.now + self.trace.requests[c].think_s, _ARRIVAL, c)
        self._kick(slot)

    # ---------------------------------------------------------------- main loop
    def run(self) -> RunResult:
        cfg = self.cfg
        self.policy.reset(self.ids, cfg.seed)  # every slot: an autoscaler may bring any of them in
        for r in self.trace.requests:
            if r.follows is None:
                self._push(r.arrival_s / cfg.load_scale, _ARRIVAL, r.index)
        if self.warmer is not None:
            self.warmer.start(self, 0.0)
        t_wall = time.perf_counter()
        events = 0
        stopped = truncated = False
        arrived = 0
        n = len(self.trace)
        while self._heap:
            if events >= cfg.max_events or (
                cfg.max_wall_s is not None and events % 4096 == 0 and time.perf_counter() - t_wall > cfg.max_wall_s
            ):
                truncated = True
                break
            t, _, _, kind, arg = heapq.heappop(self._heap)
            self.now = t
            events += 1
            if kind == _STEP_END:
                self._step_end(*arg)
            elif kind == _CALL:
                arg()
            elif kind == _READY:
                self._ready(*arg)
            elif kind == _HANDOFF:
                self._handed(arg)
            elif kind == _WINDOW:
                assert self.windows is not None
                self.windows.release(self, arg, t)
            else:
                self._arrival(arg)
                arrived += 1
                if self.progress is not None and arrived % 256 == 0:
                    self.progress(arrived, n)
            if cfg.stop_when_slo_lost and (self._ttft_bad > self._allowed_bad or self._itl_bad > self._allowed_bad):
                stopped = True
                break
        recs = [r for r in self.records if r is not None]
        res = RunResult(
            self.policy.name,
            cfg,
            recs,
            self.busy_s,
            {w: [b / cfg.util_bucket_s for b in s] for w, s in self.util.items()},
            rejected=self.rejected,
            stopped_early=stopped,
            truncated=truncated,
            events=events,
            wall_s=time.perf_counter() - t_wall,
            warm_requests=self.warm_requests,
        )
        res.summary = summarize(recs, self.busy_s, cfg.slo, cfg.gpu_hour_price, self.work_s)
        if stopped:
            res.summary["meets_slo"] = False
        res.summary.update(
            rejected=self.rejected, stopped_early=stopped, truncated=truncated, warm_requests=self.warm_requests
        )
        if self.windows is not None:
            res.summary["batching"] = self.windows.stats()
        if self.dp is not None:
            res.summary["data_plane"] = {"peer_pulls": self.pulls, **self.dp_stats}
        if cfg.pd is not None:
            res.summary["pd"] = self.pd_summary()
        return res

    def pd_summary(self) -> dict[str, Any]:
        """The run's P/D figures: split, share of requests disaggregated, handoff time (from the prefill half's
        end to the KV's arrival, NIC queueing included) p50/p99 in ms, load fallbacks, decisions by reason."""
        pd = self.cfg.pd
        assert pd is not None
        st = self.pd_stats
        n = st["disaggregated"] + st["aggregated"]
        ho = self._handoff_s
        return {
            "split": pd.split(self.cfg.workers),
            "decider": pd.decider,
            "link_gbps": pd.link_gbps,
            "disagg_share": st["disaggregated"] / n if n else 0.0,
            "handoff_ms": {"p50": 1000 * pct(ho, 50) if ho else 0.0, "p99": 1000 * pct(ho, 99) if ho else 0.0},
            "fallbacks": int(st["fallbacks"]),
            "reasons": dict(sorted(self.pd_reasons.items())),
        }


def run_policy(
    trace: Trace, policy: Policy, config: FleetConfig, hashes: HashCache | None = None, **kw: Any
) -> RunResult:
    """Convenience: build a :class:`FleetSim` and run it."""
    return FleetSim(trace, policy, config, hashes, **kw).run()
