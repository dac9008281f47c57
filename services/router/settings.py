"""Settings of the router service (flags and KVMESH_* env, see kvmesh.core.config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.config import ServerSettings, setting
from kvmesh.routing.disagg import PdParams
from kvmesh.security.guardrails import DEFAULT_MAX_MATCH_CHARS
from kvmesh.services.router.limits import SIM_VOCAB_SIZE

PD_DEFAULTS = PdParams()


@dataclass(frozen=True)
class RouterSettings(ServerSettings):
    """kvmesh router: the client-facing API and the routing decision."""

    workers: tuple[str, ...] = setting((), "static worker gRPC addresses (comma-separated)")
    cache_manager: str = setting("", "cache-manager gRPC address (index watch, FindMatches)")
    failover: tuple[str, ...] = setting((), "failover gRPC addresses to follow endpoint sets from (comma-separated)")
    model: str = setting("", "model folder for the tokenizer; default: the tiny local test model")
    model_name: str = setting("", "served model name reported by /v1/models (default: folder name)")
    tool_call_parser: str = setting(
        "",
        'vLLM tool-call parser (hermes, llama3_json, mistral, ...) that reads "auto" tool calls from the answers '
        "(vLLM's --enable-auto-tool-choice --tool-call-parser; loads vLLM and the --model tokenizer at start; "
        'empty: "auto" tool choice is refused, "required" and named functions work without it)',
    )
    reasoning_parser: str = setting(
        "",
        "vLLM reasoning parser (deepseek_r1, qwen3, ...) that moves the answers' reasoning text into `reasoning` "
        "(vLLM's --reasoning-parser; loads vLLM and the --model tokenizer at start; not for forced tool calls)",
    )
    lora_adapters: tuple[str, ...] = setting(
        (), 'LoRA adapter names the workers serve (comma-separated): gRPC lora_name or HTTP "model" selects one'
    )
    salt_model: str = setting(
        "",
        "model string in the block-hash salt make_salt(model, lora, tenant); must equal the cache-manager's "
        "--model (both default to '', which is what `kvmesh up` runs)",
    )
    block_size: int = setting(32, "tokens per KV block, equal to the workers'")
    prefix_report_queue: int = setting(
        4096,
        "prompts routed from the index replica waiting to be reported to the cache-manager (its prefix "
        "statistics); more are dropped and counted (0 = no reports)",
    )
    prefix_report_batch: int = setting(256, "most prompts in one report to the cache-manager (at most 1024)")
    prefix_report_flush_ms: int = setting(100, "a routed prompt is reported at most this long after it was routed")
    prefix_report_tokens: int = setting(
        16384, "most token ids reported with a routed prompt (of its held part), for warming and replication"
    )
    policy_file: str = setting("", "routing profile YAML (default: the built-in kvmesh profile)")
    router_replicas: int = setting(1, "router replicas sharing the workers (scales own in-flight estimates)")
    processes: int = setting(
        1,
        "router processes on this host sharing its ports (SO_REUSEPORT) and one index replica (shared memory, "
        "followed by process 0), each with its own /metrics port (0 = one per core, at most 8)",
    )
    shared_index: str = setting(
        "",
        "set by `--processes N` for its processes: the /dev/shm path of the index replica they share (process 0 "
        "writes it, the others read it; empty = this process keeps its own)",
    )
    shared_index_role: str = setting("", "set by `--processes N`: writer or reader of --shared-index")
    api_keys_file: str = setting(
        "",
        "API keys: one per line, or YAML entries {key, id, tenants, signing_secret, require_signature, role} "
        "(docs/security.md; empty = no authentication, tenants as declared)",
    )
    signature_window_s: float = setting(300.0, "signed requests: X-Kvmesh-Timestamp accepted within ± this")
    signature_replay_cache: int = setting(
        100_000, "signed requests: signatures remembered inside the window to refuse exact replays (0 = off)"
    )
    rate_limit_rps: float = setting(0.0, "requests per second per API key (0 = unlimited)")
    rate_limit_burst: float = setting(20.0, "burst size of the per-key rate limit")
    long_prompt_tokens: int = setting(2048, "prompts longer than this go to the long queue")
    short_concurrency: int = setting(256, "short prompts routed concurrently")
    short_queue: int = setting(1024, "short prompts waiting before RESOURCE_EXHAUSTED")
    long_concurrency: int = setting(16, "long prompts routed concurrently")
    long_queue: int = setting(64, "long prompts waiting before RESOURCE_EXHAUSTED")
    queue_timeout_s: float = setting(30.0, "longest wait in an admission queue")
    max_prompt_tokens: int = setting(131072, "longest accepted prompt, tokens")
    max_request_bytes: int = setting(8 * 1024 * 1024, "largest accepted HTTP request body")
    default_max_tokens: int = setting(256, "max_tokens when the client gives none")
    max_tokens_limit: int = setting(8192, "largest accepted max_tokens")
    max_retries: int = setting(3, "times one request may be re-sent before its first token")
    max_migrations: int = setting(3, "times one request may move to another worker")
    worker_transport: str = setting(
        "stream",
        "router → worker requests: stream (all on one gRPC GenerateStream per worker, a call a service mesh sees,"
        " authorises and measures) or frames (opt-in fast path: GenerateStream's messages on one plain TCP/TLS"
        " connection to each worker's --frames-port, where the worker offers it, else as stream; less router CPU"
        " per request, but opaque to a service mesh: docs/operations.md)",
    )
    load_interval_ms: int = setting(200, "load-report interval asked from workers")
    kv_pull_margin: float = setting(
        2.0, "hint a peer pull when it is this many times cheaper than recomputing (perf-model time); 0 = never"
    )
    drain_floor: float = setting(
        0.5,
        "a drain by a caller other than an admin (the planner's token) must leave at least this share of the"
        " router's workers in rotation (rounded up, at least 1): PERMISSION_DENIED naming the floor otherwise",
    )
    disaggregation: bool = setting(
        True,
        "prefill/decode disaggregation where the fleet has prefill workers (--role prefill): each request is"
        " served aggregated or disaggregated by the decision of kvmesh.routing.disagg; false: always aggregated",
    )
    pd_min_uncached_tokens: int = setting(
        PD_DEFAULTS.min_uncached_tokens, "disaggregate only a request with at least this many uncached tokens"
    )
    pd_max_prefill_queue_s: float = setting(
        PD_DEFAULTS.max_prefill_queue_s,
        "prefill in place when the best prefill worker's backlog is longer than this, seconds (perf-model time),"
        " and prefilling in place would give the first token sooner",
    )
    pd_hold_ms: int = setting(10000, "how long a prefill worker holds a prompt's KV for its decode worker, ms")
    pd_prefill_timeout_ms: int = setting(
        30000, "a prefill half not handed over by then is abandoned and the request served aggregated, ms"
    )
    worker_stale_s: float = setting(10.0, "a worker without a load report this long is out of rotation")
    breaker_p95_ms: float = setting(1200.0, "circuit breaker: p95 latency threshold")
    breaker_error_rate: float = setting(0.01, "circuit breaker: error-rate threshold")
    breaker_cooldown_s: float = setting(5.0, "circuit breaker: first cool-down")
    max_prompt_chars: int = setting(
        0,
        "longest accepted prompt text, characters, refused before tokenising (0 = max_prompt_tokens x the "
        "tokenizer's longest token, at most 32 characters)",
    )
    max_chat_messages: int = setting(1024, "most messages in one chat request")
    tokenize_cache_mb: int = setting(
        64, "memory for tokenised prompt texts, MiB: a repeated text is not tokenised again (0 = off)"
    )
    vocab_size: int = setting(
        SIM_VOCAB_SIZE,
        "token ids accepted are below this: the served model's vocabulary (default: the simulated engine's; "
        "0 = the router tokenizer's)",
    )
    http_body_timeout_s: float = setting(30.0, "longest wait for an HTTP request body (then 408)")
    report_age_intervals: float = setting(
        5.0,
        "a worker whose load reports stop is out of rotation after this many report intervals, within "
        "[report_age_floor_s, worker_stale_s], whatever its health endpoint says",
    )
    report_age_floor_s: float = setting(
        5.0, "shortest report age that takes a worker out of rotation (a busy worker's reports can lag seconds)"
    )
    stall_detection: bool = setting(
        True, "cancel and migrate a worker stream that sends no token within its stall bound (kvmesh.routing.stall)"
    )
    stall_itl_factor: float = setting(10.0, "stall bound between tokens: this × the worker's mean inter-token gap")
    stall_itl_floor_s: float = setting(1.0, "stall bound between tokens: at least this")
    stall_itl_ceiling_s: float = setting(5.0, "stall bound between tokens: at most this (and without samples)")
    stall_ttft_factor: float = setting(
        5.0, "stall bound for the first token: this × the worker's mean time to first token per prompt token × tokens"
    )
    stall_ttft_floor_s: float = setting(1.5, "stall bound for the first token: at least this")
    stall_ttft_ceiling_s: float = setting(30.0, "stall bound for the first token: at most this (and without samples)")
    hedge_first_token: bool = setting(
        False, "a request whose first token is later than its stall bound also goes to a second worker: first wins"
    )
    guardrails: str = setting(
        "",
        "output guardrail rules: a YAML file, or a directory of *.yaml files (docs/security.md; empty = off)",
    )
    guardrails_reload_s: float = setting(
        1.0, "check the guardrail files for changes this often, seconds (new rules apply from a stream's next chunk)"
    )
    guardrails_max_match_chars: int = setting(
        DEFAULT_MAX_MATCH_CHARS,
        "longest match of a regex guardrail rule without max_match_chars (text held back that long)",
    )
