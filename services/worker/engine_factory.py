"""Builds the worker's engine from its settings."""

from __future__ import annotations

import math
import os
import shlex
import time
import uuid
from pathlib import Path
from typing import Any

from kvmesh.core.errors import FailedPrecondition, InvalidArgument
from kvmesh.core.handoff import WorkerRole
from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.engine.base import Engine
from kvmesh.engine.clock import Clock, RealClock, VirtualClock
from kvmesh.engine.sim.core import SimConfig
from kvmesh.engine.sim.driver import SimEngine
from kvmesh.engine.sim.tiers import DiskTier, HostTiers, sim_layout, tiny_block_bytes
from kvmesh.engine.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer
from kvmesh.kvplane.kvsync.tier import TierRegion, region_name
from kvmesh.kvplane.pulls import PeerPulls
from kvmesh.services.worker.settings import WorkerSettings

SIM_MODEL_NAME = "sim-llama-3.1-70b-fp8"


def tiny_model_dir() -> Path:
    """The tiny test model scripts/build_tiny_model.py built, where `kvmesh.core.modelfiles` finds it (as the
    router does); where that script puts it by default when it is not built yet (the engine then says so)."""
    found = resolve_model_dir("")
    if found is not None:
        return found
    home = os.environ.get("KVMESH_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "kvmesh") / "models" / "tiny-llama"


def model_name(s: WorkerSettings) -> str:
    if s.engine == "sim":
        return s.model or SIM_MODEL_NAME
    return s.model or str(tiny_model_dir())


def build_tiers(s: WorkerSettings) -> HostTiers | None:
    """The sim engine's CPU tier (a fresh shared-memory region) and disk tier, from the flags; None if both off."""
    block_bytes = s.tier_block_bytes or tiny_block_bytes(s.block_size)
    cpu_slots = int(s.cpu_tier_mb * (1 << 20)) // block_bytes
    disk_slots = int(s.disk_tier_mb * (1 << 20)) // block_bytes if s.disk_tier_dir else 0
    if cpu_slots < 1 and disk_slots < 1:
        return None
    layout = sim_layout(model_name(s), s.block_size, block_bytes)
    cpu = TierRegion.create(region_name(uuid.uuid4().hex[:16]), block_bytes, cpu_slots, layout) if cpu_slots else None
    disk = DiskTier(s.disk_tier_dir, block_bytes, disk_slots) if disk_slots else None
    return HostTiers(cpu, disk, layout, lease_clock_ns=time.monotonic_ns)


def vllm_tier_fields(s: WorkerSettings) -> dict[str, Any]:
    """VllmEngineConfig's KV connector fields: its CPU tier of `--cpu-tier-mb` (0 turns the connector off:
    it would otherwise keep a one-slot tier) under shm name `kvmesh-<worker id>-<pid>`, and the staging region
    of its pulls from other hosts (`--pull-staging-mb`)."""
    tier_bytes = int(s.cpu_tier_mb * (1 << 20))
    return {
        "worker_id": s.service_id or "worker",
        "kv_connector": tier_bytes > 0,
        "kv_tier_bytes": tier_bytes,
        "pull_staging_bytes": int(s.pull_staging_mb * (1 << 20)),
    }


def engine_handoff(engine: Engine) -> bool:
    """Whether the engine hands a prefill half's KV over by its own transfer (vLLM's NixlConnector): the
    worker's `WorkerApp.engine_handoff`, reported by GetInfo; kv-sync hands over otherwise."""
    return bool(getattr(engine, "engine_handoff", False))


def build_engine(s: WorkerSettings, peers: PeerPulls | None = None) -> Engine:
    """The engine of `--engine`; `peers` is where it pulls prefixes from (None: it pulls nothing)."""
    if s.engine == "sim":
        if not 0 <= s.sim_extra_step_ms < math.inf:
            raise InvalidArgument("sim_extra_step_ms", f"must be a finite number of ms >= 0, got {s.sim_extra_step_ms}")
        tok: Tokenizer = ByteTokenizer()
        vocab = 128256
        if s.model and (Path(s.model) / "tokenizer.json").exists():
            hf = HfTokenizer(s.model)
            tok, vocab = hf, hf.vocab_size
        cfg = SimConfig(
            block_size=s.block_size,
            num_blocks=s.kv_blocks,
            max_waiting=s.max_queue,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            vocab_size=vocab,
            extra_step_s=s.sim_extra_step_ms / 1000.0,
            output_salt=s.sim_output_salt,
        )
        clock: Clock = VirtualClock() if s.sim_speed == 0 else RealClock(s.sim_speed)
        return SimEngine(
            cfg,
            model_name=model_name(s),
            clock=clock,
            tokenizer=tok,
            tiers=build_tiers(s),
            pull_transport=peers,
        )
    if s.engine == "vllm":
        from kvmesh.engine.vllm_config import VllmEngineConfig, nixl_importable
        from kvmesh.engine.vllm_engine import VllmEngine

        model = model_name(s)
        if not s.model and not Path(model).exists():
            raise FailedPrecondition(f"no model given and {model} is missing: run scripts/build_tiny_model.py")
        return VllmEngine(
            VllmEngineConfig(
                model=model,
                block_size=s.block_size,
                max_model_len=s.max_model_len,
                dtype=s.vllm_dtype,
                extra_args=tuple(shlex.split(s.vllm_args)),
                cpu_kvcache_space_gib=s.vllm_cpu_kvcache_gib,
                # vLLM's NixlConnector beside kvmesh's when NIXL is installed (`pip install kvmesh[nixl]`), on a
                # worker of a disaggregated pool only: NIXL's progress thread polls (half a core when idle), and a
                # `both` worker hands nothing over
                engine_handoff=s.vllm_nixl and s.worker_role is not WorkerRole.BOTH and nixl_importable(),
                handoff_hold_ms=s.handoff_hold_ms,
                **vllm_tier_fields(s),
            ),
            peers=peers,
        )
    raise InvalidArgument("engine", f"unknown engine {s.engine!r} (sim or vllm)")
