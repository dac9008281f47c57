"""Entry point: `python -m kvmesh.services.cache_manager` / `kvmesh-cache-manager`."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from kvmesh.cachemgr.core import CacheCore
from kvmesh.cachemgr.publisher import PublishLimits
from kvmesh.core.config import key_map
from kvmesh.core.kvevents import KvEventBatch
from kvmesh.discovery.model import REPLICATION_PENDING_META
from kvmesh.discovery.registration import registry_from
from kvmesh.discovery.watcher import DiscoveryWatcher
from kvmesh.index.types import IngestResult
from kvmesh.ops.warming import Template, WarmingConfig, load_templates
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.rpc.server import BoundPorts, ServiceRunner, run_service
from kvmesh.services.cache_manager import metrics as m
from kvmesh.services.cache_manager.replication import ReplicaSink, Replicator
from kvmesh.services.cache_manager.servicer import CacheManagerServicer, count, refresh_gauges
from kvmesh.services.cache_manager.settings import CacheManagerSettings
from kvmesh.services.cache_manager.warming import Warmer, registry_address
from kvmesh.services.cache_manager.zones import ZoneFollowers, parse_follow_zones
from kvmesh.store.base import CheckpointStore
from kvmesh.store.file import FileCheckpointStore
from kvmesh.v1 import cache_manager_pb2_grpc
from kvmesh.wire.zmq_subscriber import VllmZmqSubscriber

log = logging.getLogger(__name__)


def make_store(s: CacheManagerSettings) -> tuple[CheckpointStore | None, str]:
    """Redis when configured, else a file store when a directory is given, else none."""
    if s.redis_url:
        from kvmesh.store.redis_store import RedisCheckpointStore

        return RedisCheckpointStore.from_url(s.redis_url, s.redis_prefix), f"{s.redis_url}#{s.redis_prefix}"
    if s.checkpoint_dir:
        return FileCheckpointStore(s.checkpoint_dir), f"file://{s.checkpoint_dir}"
    return None, ""


class ZmqSink:
    """Adapter: vLLM ZMQ batches into the core, counted, with the log flushed by the flush loop."""

    def __init__(self, core: CacheCore, wake: asyncio.Event) -> None:
        self.core, self.wake = core, wake

    def apply(self, batch: KvEventBatch) -> IngestResult:
        res = self.core.apply(batch)
        m.EVENTS.inc(len(batch.events))
        count(res, "zmq")
        self.wake.set()
        return res

    def replay_failed(self, worker_id: str, reason: str = "replay incomplete") -> IngestResult:
        res = self.core.replay_failed(worker_id, reason)
        count(res, "zmq")
        self.wake.set()
        return res

    def is_replaying(self, worker_id: str) -> bool:
        return self.core.is_replaying(worker_id)


def parse_zmq(spec: str) -> tuple[str, str, str | None]:
    """`worker_id=PUB[;REPLAY]` → (worker_id, pub, replay)."""
    wid, _, rest = spec.partition("=")
    pub, _, replay = rest.partition(";")
    if not wid or not pub:
        raise ValueError(f"--vllm-zmq entry {spec!r}: expected worker_id=PUB_ENDPOINT[;REPLAY_ENDPOINT]")
    return wid, pub, replay or None


def read_templates(path: str) -> list[Template]:
    """Templates from a YAML/JSON file: a list of mappings, or a mapping with a `templates` list."""
    if not path:
        return []
    data = yaml.safe_load(Path(path).read_text())
    items = data.get("templates", []) if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a list of templates")
    return load_templates(items)  # no tokenizer here: templates give token_ids


async def build(runner: ServiceRunner, settings: CacheManagerSettings) -> None:
    """Wires the cache-manager: store, core, servicer, ZMQ subscribers and periodic loops."""
    store, location = make_store(settings)
    registry = registry_from(settings.registry_file, settings.consul_url)
    watcher = DiscoveryWatcher(registry) if registry is not None else None
    followed = parse_follow_zones(settings.follow_zone, settings.zone)
    core = CacheCore(
        settings.block_size,
        settings.model,
        store,
        window_s=settings.warm_window_s,
        journal_revisions=settings.watch_journal_revisions,
        zones=list(followed),
    )
    security = ChannelSecurity.of(settings)
    zones = ZoneFollowers(core, followed, security, (settings.block_size, settings.model)) if followed else None
    cfg = WarmingConfig(
        threshold=settings.warm_threshold, window_s=settings.warm_window_s, max_replicas=settings.warm_max_replicas
    )
    warmer = Warmer(
        core,
        cfg,
        settings.warm_capacity_blocks,
        settings.warm_half_life_s,
        templates=read_templates(settings.warm_templates),
        lfu_weight=settings.warm_lfu_weight if settings.warm_lfu_weight >= 0 else None,
        security=security,
        directory=(lambda w: registry_address(watcher.snapshot, w)) if watcher is not None else None,
    )
    limits = PublishLimits(settings.publish_max_workers, settings.publish_burst_blocks, settings.publish_blocks_per_s)
    sink = ReplicaSink(
        core,
        warmer,
        key_map("kvsync_address_map", settings.kvsync_address_map, "FROM=TO"),
        settings.replication_pull_timeout_ms,
    )
    replicator = None
    if zones is not None and settings.replication_bytes_per_s > 0:
        replicator = Replicator(
            core,
            warmer,
            zones,
            security,
            settings.zone,
            settings.replication_bytes_per_s,
            settings.replication_interval_s,
            settings.replication_threshold,
            lease_ms=settings.replication_lease_ms,
        )
    servicer = CacheManagerServicer(
        core, warmer, runner.stopping, location, limits, settings.zone, zones, sink, replicator
    )
    runner.add_servicer(
        cache_manager_pb2_grpc.add_CacheManagerServiceServicer_to_server, servicer, "kvmesh.v1.CacheManagerService"
    )
    zmq_specs = [parse_zmq(s) for s in settings.vllm_zmq]
    wake = asyncio.Event()

    async def flush_loop() -> None:
        while True:
            await wake.wait()
            wake.clear()
            try:
                await core.persist()
            except Exception as e:
                m.store_failure(e)
                raise

    async def checkpoint() -> None:
        try:
            await core.checkpoint()
        except Exception as e:
            m.store_failure(e)
            raise
        m.CHECKPOINTS.inc()

    async def gauges() -> None:
        refresh_gauges(core)
        if zones is not None:
            zones.stats()  # refreshes the per-zone gauges

    async def started(_ports: BoundPorts) -> None:
        if store is not None:
            rec = await core.restore()
            log.info(
                "recovered %d pairs (+%d log records) from %s in %.3fs",
                core.index.num_pairs(),
                rec.records,
                location,
                rec.load_s + rec.restore_s + rec.replay_s,
            )
        refresh_gauges(core)
        if watcher is not None:
            await watcher.start()
        sink = ZmqSink(core, wake)
        for wid, pub, replay in zmq_specs:
            sub = VllmZmqSubscriber(wid, pub, replay, sink)
            runner.supervise(functools.partial(sub.run, runner.stopping), name=f"vllm-zmq-{wid}")
        runner.supervise(flush_loop, name="flush")
        if zones is not None:
            zones.start()  # after the restore: each zone resumes from its checkpointed revision
        runner.every(5.0, gauges, name="gauges")
        if store is not None:
            runner.every(settings.checkpoint_interval_s, checkpoint, name="checkpoint")
        runner.every(settings.warm_interval_s, warmer.dynamic_round, name="warming")
        if replicator is not None:

            async def replication_round() -> None:
                await replicator.round()
                await runner.set_meta(REPLICATION_PENDING_META, ",".join(replicator.pending_zones()))

            runner.every(settings.replication_interval_s, replication_round, name="replication")

    async def stopped() -> None:  # background tasks are stopped by now: persist what they left
        if zones is not None:
            await zones.stop()  # before the last checkpoint: it holds the copies as they stop
        if store is not None:
            try:
                await core.persist()
                await checkpoint()
            except Exception as e:  # a full or lost store must not hold the stop: the last checkpoint stands
                log.warning("the final checkpoint into %s failed: %s", location, e)
            await store.close()
        if replicator is not None:
            await replicator.close()
        await warmer.close()
        if watcher is not None and registry is not None:
            await watcher.stop()
            await registry.close()

    runner.on_started.append(started)
    runner.on_stopped.append(stopped)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("cache-manager", CacheManagerSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
