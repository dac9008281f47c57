"""Warming actions of the cache-manager: prefill-only `Generate` calls through the worker API.

Decisions come from `kvmesh.ops.warming` (pure); this module supplies their inputs and issues the requests:

* holders of a prefix = workers whose indexed blocks match all of its full blocks (under its tenant);
* load(w) = indexed blocks of w / Σ indexed blocks of the registered workers (a worker holding at least
  `max_load` of the zone's cached blocks takes no more dynamic warming; 0 for all while the index is empty);
* static templates (`--warm-templates`) are preloaded when workers register (and retried every round) onto
  `replicas` workers each (0 = every worker); completed preloads count as held even before their KV events
  reach the index, so a template is not sent twice to one worker;
* every FindMatches observation of a warm prefix is an access of the LFU+LRU warm set (`on_observe`).

Where a worker is dialled: with a registry configured (`--registry-file` / `--consul-url`), only at the
address the registry gives for that worker id (`directory`); the address in a publisher's hello is then
never dialled (it is whatever the publisher says: trusting it let a forger make the cache-manager connect
anywhere, an SSRF). A worker said hello but absent from the registry is not warmed. Without a registry, the
hello's address is used as before (the publisher's identity is checked by `kvmesh.cachemgr.publisher`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace

import grpc

from kvmesh.cachemgr.core import CacheCore
from kvmesh.core.errors import Unavailable
from kvmesh.discovery.model import CatalogSnapshot, Role
from kvmesh.ops.warming import HybridWarmSet, Template, WarmAction, WarmingConfig, plan_dynamic, plan_static
from kvmesh.ops.warming.decide import pick_workers
from kvmesh.ops.warming.stats import PrefixInfo
from kvmesh.rpc.channel import ChannelSecurity, open_channel
from kvmesh.services.cache_manager import metrics as m
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
ANY_LOAD = 2.0  # above every load share: operator-requested warming (templates, WarmPrefixes) is not gated
Directory = Callable[[str], "str | None"]  # worker id -> the address the registry gives (None: not registered)


def registry_address(snap: CatalogSnapshot, worker_id: str) -> str | None:
    """`host:port` of the registered worker `worker_id` (None when the registry has no such worker)."""
    inst = snap.by_id().get(worker_id)
    return inst.target if inst is not None and inst.role is Role.WORKER else None


class Warmer:
    """Worker registry + warming rounds (see module docstring)."""

    def __init__(
        self,
        core: CacheCore,
        cfg: WarmingConfig,
        capacity_blocks: int,
        half_life_s: float,
        request_timeout_s: float = 60.0,
        templates: Sequence[Template] = (),
        lfu_weight: float | None = None,
        security: ChannelSecurity | None = None,
        directory: Directory | None = None,
    ) -> None:
        self.core = core
        self.security = security  # the workers' channels: TLS as the service is configured
        self.directory = directory
        self.cfg = cfg
        self.warm = HybridWarmSet(capacity_blocks, half_life_s, lfu_weight)
        self.addresses: dict[str, str] = {}  # workers that said hello -> the address their hello declared
        self.channels: dict[str, tuple[str, grpc.aio.Channel]] = {}  # worker -> (dialled address, channel)
        self.request_timeout_s = request_timeout_s
        self.actions_total = 0
        self.templates = list(templates)
        self.static_done: dict[int, set[str]] = {}  # template index -> workers a preload completed on
        self._static_lock = asyncio.Lock()
        self._tasks: set[asyncio.Future[object]] = set()
        core.on_observe = self._touched

    def _touched(self, keys: Sequence[int], now: float) -> None:
        for k in keys:
            self.warm.touch(k, now)

    def register(self, worker_id: str, address: str) -> None:
        """A worker said hello; a new worker (or address) triggers the static preload (in the background).
        Without a directory a hello without an address registers nothing (the worker cannot be dialled)."""
        if (address or self.directory is not None) and self.addresses.get(worker_id) != address:
            self.addresses[worker_id] = address
            if self.templates:
                self._background(self.static_round())

    def _background(self, coro: Coroutine[object, object, object]) -> None:
        """Run `coro` in the background, cancelled by `close`."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def loads(self) -> dict[str, float]:
        """load(w) = indexed blocks of w / Σ indexed blocks over the registered workers (0 when empty)."""
        n = {w: self.core.index.num_blocks(w) for w in self.addresses}
        total = sum(n.values()) or 1
        return {w: v / total for w, v in n.items()}

    def holders(self, token_ids: Sequence[int], tenant: str | None = None) -> set[str]:
        hs = self.core.hashes_of(token_ids, tenant=tenant)
        return {w for w, k in self.core.index.find_matches(hs).items() if k == len(hs)}

    async def static_round(self) -> int:
        """Preload the templates still missing replicas (serialised); returns requests completed."""
        if not self.templates:
            return 0
        async with self._static_lock:
            keys = [self._template_key(i, t) for i, t in enumerate(self.templates)]
            index_of = {k: i for i, k in enumerate(keys)}

            def holders(t: Template) -> set[str]:
                i = self.templates.index(t)
                return self.holders(t.token_ids) | self.static_done.get(i, set())

            plan = plan_static(
                self.templates,
                self.loads(),
                holders,
                self.warm,
                lambda t: keys[self.templates.index(t)],
                self.core.block_size,
                ANY_LOAD,
            )
            done = await self.issue(plan.actions)
            for a, ok in done:
                if ok:
                    self.static_done.setdefault(index_of[a.key], set()).add(a.worker)
            return sum(ok for _a, ok in done)

    def _template_key(self, i: int, t: Template) -> int:
        """Warm-set key of a template: the index hash of its last full block (else its position)."""
        hs = self.core.hashes_of(t.token_ids)
        return hs[-1] if hs else i

    async def warm_now(self, prompts: Sequence[Sequence[int]], replicas: int) -> int:
        """Make each prompt held by `replicas` workers (0 = policy default 1 + …); returns requests sent."""
        loads = self.loads()
        actions = []
        for p in prompts:
            have = self.holders(p)
            want = (replicas or 1) - len(have)
            for w in pick_workers(have, loads, want, ANY_LOAD):
                actions.append(WarmAction(w, 0, tuple(p), "manual"))
        return sum(ok for _a, ok in await self.issue(actions))

    async def dynamic_round(self) -> int:
        """One round: the static preloads still missing, then dynamic warming of hot prefixes."""
        n = await self.static_round()

        def holders(_key: int, inf: PrefixInfo) -> set[str]:
            return self.holders(inf.token_ids or (), inf.tenant)

        plan = plan_dynamic(self.core.stats, time.time(), self.loads(), holders, self.warm, self.cfg)
        m.WARMING_COOLED.inc(len(plan.cooled))
        return n + sum(ok for _a, ok in await self.issue(plan.actions))

    async def issue(self, actions: Sequence[WarmAction]) -> list[tuple[WarmAction, bool]]:
        """Send prefill-only requests concurrently; returns (action, completed) pairs."""
        if not actions:
            return []
        results = await asyncio.gather(*(self._prefill(a) for a in actions), return_exceptions=True)
        out = []
        for a, r in zip(actions, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("warming %s on %s failed: %s", a.reason, a.worker, r)
            else:
                m.WARMING.labels(a.reason).inc()
                self.actions_total += 1
            out.append((a, not isinstance(r, BaseException)))
        return out

    def dial_address(self, worker_id: str) -> str | None:
        """Where `worker_id` is dialled: the registry's address when a directory is set, else its hello's."""
        if self.directory is not None:
            return self.directory(worker_id)
        return self.addresses.get(worker_id) or None

    def worker_channel(self, worker_id: str) -> grpc.aio.Channel:
        addr = self.dial_address(worker_id)
        if addr is None:
            raise Unavailable(f"worker {worker_id!r} is not in the registry: not dialled")
        cur = self.channels.get(worker_id)
        if cur is not None and cur[0] == addr:
            return cur[1]
        if cur is not None:  # the address changed: the old channel is closed in the background
            self._background(cur[1].close())
        ch = open_channel(addr, self.security)
        self.channels[worker_id] = (addr, ch)
        return ch

    async def _prefill(self, a: WarmAction, pull: worker_pb2.KvPullHint | None = None) -> common_pb2.Usage:
        """A prefill-only request (its blocks pulled from a peer first when `pull` is given); its usage."""
        ch = self.worker_channel(a.worker)
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        req = worker_pb2.GenerateRequest(
            request_id=f"warm-{uuid.uuid4().hex[:12]}",
            token_ids=common_pb2.TokenIds(ids=list(a.token_ids)),
            sampling=common_pb2.SamplingParams(max_tokens=1),
            prefill_only=True,
            tenant=a.tenant or "",
            kv_pull=pull,
        )
        usage = common_pb2.Usage()
        async for msg in stub.Generate(req, timeout=self.request_timeout_s):
            if msg.HasField("usage"):
                usage = msg.usage
        return usage

    async def pull_prefill(self, a: WarmAction, pull: worker_pb2.KvPullHint) -> common_pb2.Usage:
        """`a` with its leading blocks pulled as `pull` says (hot-prefix replication from another zone)."""
        usage = await self._prefill(a, pull)
        m.WARMING.labels(a.reason).inc()
        self.actions_total += 1
        return usage

    def set_policy(self, p: pb.WarmingPolicy) -> pb.WarmingPolicy:
        """Apply non-zero fields; returns the policy in force (lfu_weight 0 there = the default LRFU score)."""
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
        if p.lfu_weight:
            self.warm.set_lfu_weight(p.lfu_weight)
        self.cfg = cfg
        return pb.WarmingPolicy(
            hot_threshold=cfg.threshold,
            window_s=cfg.window_s,
            max_replicas=cfg.max_replicas,
            capacity=self.warm.capacity,
            lfu_weight=self.warm.lfu_weight or 0.0,
        )

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for _addr, ch in self.channels.values():
            await ch.close()
