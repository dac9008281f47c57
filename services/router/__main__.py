"""Entry point: `python -m kvmesh.services.router` / `kvmesh-router`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvmesh.core.config import load_settings
from kvmesh.index import NATIVE
from kvmesh.index.shared import remove_files
from kvmesh.routing import Admission, BreakerConfig, InflightTracker, Profile, QueueLimits
from kvmesh.routing.disagg import PdParams
from kvmesh.routing.stall import StallConfig
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.rpc.interceptors import MessageBounds
from kvmesh.rpc.processes import Supervisor, process_count
from kvmesh.rpc.server import BoundPorts, ServerLimits, ServiceRunner, run_service
from kvmesh.security.client_keys import ClientKeys
from kvmesh.services.router import metrics as m
from kvmesh.services.router.auth import RateLimiter
from kvmesh.services.router.core import RouterCore
from kvmesh.services.router.disaggregation import PdSettings
from kvmesh.services.router.follow import FailoverFollower
from kvmesh.services.router.frontend import Frontend
from kvmesh.services.router.guarded import OutputGuard
from kvmesh.services.router.guardrails_watch import GuardrailsWatch
from kvmesh.services.router.http_api import HttpApi
from kvmesh.services.router.index_replica import IndexReplica, shared_role
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.servicer import RouterAdminServicer, RouterServicer, add_router_service
from kvmesh.services.router.settings import RouterSettings
from kvmesh.services.router.tokenize import CHARS_PER_TOKEN_CAP, RouterTokenizer
from kvmesh.services.router.tool_parsing import OutputParser
from kvmesh.services.router.workers import WorkerPool
from kvmesh.telemetry.logging import setup_logging
from kvmesh.v1 import router_pb2_grpc


def build_frontend(settings: RouterSettings) -> Frontend:
    """Everything but the servers: profile, pool, index replica, admission, core, tokenizer, auth."""
    s = settings
    profile = Profile.from_yaml(Path(s.policy_file).read_text()) if s.policy_file else Profile.default()
    tracker = InflightTracker(replicas=max(s.router_replicas, 1))
    breaker = BreakerConfig(
        p95_threshold_ms=s.breaker_p95_ms, error_rate_threshold=s.breaker_error_rate, cooldown_s=s.breaker_cooldown_s
    )
    pool = WorkerPool(
        list(s.workers),
        s,
        tracker,
        breaker,
        load_interval_ms=s.load_interval_ms,
        max_report_age_s=s.worker_stale_s,
        transport=s.worker_transport,
        block_size=s.block_size,
        report_age_intervals=s.report_age_intervals,
        report_age_floor_s=s.report_age_floor_s,
    )
    index = IndexReplica(
        s.cache_manager,
        s,
        expect=(s.block_size, s.salt_model),
        report_queue=s.prefix_report_queue,
        report_batch=s.prefix_report_batch,
        report_flush_s=s.prefix_report_flush_ms / 1000,
        report_tokens=s.prefix_report_tokens,
        shared_index=s.shared_index,
        shared_role=shared_role(s),
    )
    admission = Admission(
        short=QueueLimits(s.short_concurrency, s.short_queue),
        long=QueueLimits(s.long_concurrency, s.long_queue),
        long_prompt_tokens=s.long_prompt_tokens,
    )
    limits = CoreLimits(
        block_size=s.block_size,
        max_prompt_tokens=s.max_prompt_tokens,
        default_max_tokens=s.default_max_tokens,
        max_tokens_limit=s.max_tokens_limit,
        max_retries=s.max_retries,
        max_migrations=s.max_migrations,
        queue_timeout_s=s.queue_timeout_s,
    )
    tok = RouterTokenizer(s.model, s.tokenize_cache_mb)
    m.TOKEN_CACHE.stats = tok.cache.stats
    limits.max_prompt_chars = s.max_prompt_chars or s.max_prompt_tokens * tok.max_chars_per_token
    limits.max_chat_messages = s.max_chat_messages
    limits.vocab_size = s.vocab_size or tok.vocab_size
    model_name = s.model_name or tok.name
    stall = StallConfig(
        enabled=s.stall_detection,
        itl_factor=s.stall_itl_factor,
        itl_floor_s=s.stall_itl_floor_s,
        itl_ceiling_s=s.stall_itl_ceiling_s,
        ttft_factor=s.stall_ttft_factor,
        ttft_floor_s=s.stall_ttft_floor_s,
        ttft_ceiling_s=s.stall_ttft_ceiling_s,
        hedge=s.hedge_first_token,
    )
    core = RouterCore(
        profile,
        pool,
        index,
        tracker,
        admission,
        limits,
        salt_model=s.salt_model,
        stall=stall,
        pull_margin=s.kv_pull_margin,
        pd=PdSettings(s.disaggregation, s.pd_hold_ms, s.pd_prefill_timeout_ms),
        pd_params=PdParams(min_uncached_tokens=s.pd_min_uncached_tokens, max_prefill_queue_s=s.pd_max_prefill_queue_s),
    )
    keys = ClientKeys.load(s.api_keys_file, window_s=s.signature_window_s, replay_capacity=s.signature_replay_cache)
    front = Frontend(
        core, tok, keys, RateLimiter(s.rate_limit_rps, s.rate_limit_burst), model_name, lora_adapters=s.lora_adapters
    )
    front.drain_floor = s.drain_floor
    return front


def server_limits(s: RouterSettings) -> ServerLimits:
    """gRPC: a Generate request up to what the prompt limits allow (UTF-8 text of `max_prompt_chars`, or
    token ids and resumed ids at <= 5 bytes each, plus 1 MiB for the rest), the other methods 1 MiB, each
    refused on its size before it is decoded; HTTP: `max_request_bytes`."""
    chars = s.max_prompt_chars or s.max_prompt_tokens * CHARS_PER_TOKEN_CAP
    ids = 5 * (s.max_prompt_tokens + s.max_tokens_limit)
    generate = {"/kvmesh.v1.RouterService/Generate": max(4 * chars, ids) + 2**20}
    return ServerLimits(MessageBounds(2**20, generate), http_max_body_bytes=s.max_request_bytes)


async def build(runner: ServiceRunner, settings: RouterSettings) -> None:
    """Wires the router: frontend, servicers, HTTP API, failover follower; a cache-manager whose block size
    or salt model disagrees with the router's fails the start."""
    front = build_frontend(settings)
    follower: FailoverFollower | None = None
    if settings.failover:
        follower = FailoverFollower(
            settings.failover,
            settings.zone,
            front.core.pool,
            front.core.index,
            static_workers=settings.workers,
            static_cache_manager=settings.cache_manager,
            security=ChannelSecurity.of(settings),
        )
    if settings.guardrails:  # a bad rule file fails the start, naming the file, line and rule
        guard = front.guard = OutputGuard()
        watch = front.guardrails = GuardrailsWatch(settings.guardrails, settings.guardrails_max_match_chars, guard.swap)
        watch.load()
        runner.every(settings.guardrails_reload_s, watch.poll, name="guardrails")
    runner.add_servicer(add_router_service, RouterServicer(front), "kvmesh.v1.RouterService")
    runner.add_servicer(
        router_pb2_grpc.add_RouterAdminServiceServicer_to_server,
        RouterAdminServicer(front),
        "kvmesh.v1.RouterAdminService",
    )
    parser = None
    if settings.tool_call_parser or settings.reasoning_parser:  # vLLM is loaded only then
        parser = OutputParser(settings.tool_call_parser, settings.reasoning_parser, front.tokenizer.model_dir)
    HttpApi(front, settings.max_request_bytes, settings.http_body_timeout_s, parser).install(runner.http_app)

    async def started(_ports: BoundPorts) -> None:
        await front.core.index.check_agreement()
        await front.core.index.start()
        await front.core.pool.start()
        if follower is not None:  # bounded wait for the first endpoint sets (the last known ones keep serving)
            await follower.start()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(follower.first.wait(), 5.0)
        # the ready file is written after this hook: wait (bounded) for the first load reports and index sync
        await front.core.pool.settle()
        if front.core.index.address:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(front.core.index.synced.wait(), 5.0)

    async def stopped() -> None:
        if follower is not None:
            await follower.stop()
        await front.core.pool.stop()
        await front.core.index.stop()

    runner.on_started.append(started)
    runner.on_stopped.append(stopped)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    s = load_settings(RouterSettings, args, service="router")
    try:
        n = process_count(s.processes)
        shared_role(s)
    except ValueError as exc:
        print(f"kvmesh-router: {exc}", file=sys.stderr)
        return 2
    if n == 1:
        return run_service("router", RouterSettings, build, args, limits=server_limits)
    setup_logging("router", s.log_level, s.log_format, s.log_repeat_limit, s.log_repeat_window_s)
    # the in-flight estimates of each process count for every process of every replica (no herding)
    replicas = ["--router-replicas", str(max(s.router_replicas, 1) * n)]
    shared = shared_index_path(s)

    def flags(i: int) -> list[str]:
        if not shared:
            return replicas
        return [*replicas, "--shared-index", shared, "--shared-index-role", "writer" if i == 0 else "reader"]

    try:
        supervisor = Supervisor("router", "kvmesh.services.router", args, s, n, flags)
    except OSError as exc:  # e.g. the port is taken
        print(f"kvmesh-router: cannot bind {s.host}:{s.port} or HTTP port {s.http_port}: {exc}", file=sys.stderr)
        return 2
    try:
        return supervisor.run()
    finally:
        if shared:
            remove_files(shared)


def shared_index_path(s: RouterSettings) -> str:
    """Where the processes of `--processes N` share one index replica: /dev/shm, named after this supervisor
    (empty: no cache-manager to follow, from the flags or failover; no /dev/shm; or no compiled index: then
    each process keeps its own)."""
    if not (s.cache_manager or s.failover) or not NATIVE or not os.path.isdir("/dev/shm"):
        return ""
    return f"/dev/shm/kvmesh-router-{os.getpid()}-index"


if __name__ == "__main__":
    sys.exit(main())
