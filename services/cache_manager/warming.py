"""Warming actions of the cache-manager: prefill-only `Generate` calls through the worker API.

Decisions come from `kvmesh.warming` (pure); this module supplies their inputs (holders from the index,
load = a worker's share of the largest worker's indexed blocks) and issues the requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

import grpc

from kvmesh.cachemgr.core import CacheCore
from kvmesh.rpc.channel import open_channel
from kvmesh.services.cache_manager import metrics as m
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.warming import HybridWarmSet, WarmAction, WarmingConfig, plan_dynamic
from kvmesh.warming.decide import pick_workers
from kvmesh.warming.stats import PrefixInfo

log = logging.getLogger(__name__)


class Warmer:
    """Worker registry + warming rounds (see module docstring)."""

    def __init__(self, core: CacheCore, cfg: WarmingConfig, capacity_blocks: int, half_life_s: float,
                 request_timeout_s: float = 60.0) -> None:
        self.core = core
        self.cfg = cfg
        self.warm = HybridWarmSet(capacity_blocks, half_life_s)
        self.addresses: dict[str, str] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.request_timeout_s = request_timeout_s
        self.actions_total = 0

    def register(self, worker_id: str, address: str) -> None:
        if address:
            self.addresses[worker_id] = address

    def loads(self) -> dict[str, float]:
        """load(w) = indexed blocks of w / max over workers (only workers with an address)."""
        n = {w: self.core.index.num_blocks(w) for w in self.addresses}
        top = max(n.values(), default=0) or 1
        return {w: v / top for w, v in n.items()}

    def holders(self, token_ids: Sequence[int]) -> set[str]:
        hs = self.core.hashes_of(token_ids)
        return {w for w, k in self.core.index.find_matches(hs).items() if k == len(hs)}

    async def warm_now(self, prompts: Sequence[Sequence[int]], replicas: int) -> int:
        """Make each prompt held by `replicas` workers (0 = policy default 1 + …); returns requests sent."""
        loads = self.loads()
        actions = []
        for p in prompts:
            have = self.holders(p)
            want = (replicas or 1) - len(have)
            for w in pick_workers(have, loads, want, self.cfg.max_load):
                actions.append(WarmAction(w, 0, tuple(p), "manual"))
        return await self.issue(actions)

    async def dynamic_round(self) -> int:
        """One round of dynamic warming."""
        def holders(_key: int, inf: PrefixInfo) -> set[str]:
            return self.holders(inf.token_ids or ())

        plan = plan_dynamic(self.core.stats, time.time(), self.loads(), holders, self.warm, self.cfg)
        m.WARMING_COOLED.inc(len(plan.cooled))
        return await self.issue(plan.actions)

    async def issue(self, actions: Sequence[WarmAction]) -> int:
        """Send prefill-only requests concurrently; returns how many completed."""
        if not actions:
            return 0
        results = await asyncio.gather(*(self._prefill(a) for a in actions), return_exceptions=True)
        ok = 0
        for a, r in zip(actions, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("warming %s on %s failed: %s", a.reason, a.worker, r)
            else:
                ok += 1
                m.WARMING.labels(a.reason).inc()
        self.actions_total += ok
        return ok

    async def _prefill(self, a: WarmAction) -> None:
        ch = self.channels.get(a.worker)
        if ch is None:
            ch = self.channels[a.worker] = open_channel(self.addresses[a.worker])
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        req = worker_pb2.GenerateRequest(request_id=f"warm-{uuid.uuid4().hex[:12]}",
                                         token_ids=common_pb2.TokenIds(ids=list(a.token_ids)),
                                         sampling=common_pb2.SamplingParams(max_tokens=1), prefill_only=True)
        async for _ in stub.Generate(req, timeout=self.request_timeout_s):
            pass

    def set_policy(self, p: pb.WarmingPolicy) -> pb.WarmingPolicy:
        """Apply non-zero fields; returns the policy in force."""
        cfg = self.cfg
        if p.hot_threshold:
            cfg = replace(cfg, threshold=p.hot_threshold)
        if p.max_replicas:
            cfg = replace(cfg, max_replicas=p.max_replicas)
        if p.window_s:
            cfg = replace(cfg, window_s=p.window_s)
            self.core.stats.window_s = p.window_s
        if p.capacity:
            self.warm.capacity = p.capacity
        self.cfg = cfg
        return pb.WarmingPolicy(hot_threshold=cfg.threshold, window_s=cfg.window_s, max_replicas=cfg.max_replicas,
                                capacity=self.warm.capacity, lfu_weight=p.lfu_weight)

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()
