"""Settings of the failover service (flags and KVMESH_* env, see kvmesh.core.config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.config import ServerSettings, setting


@dataclass(frozen=True)
class FailoverSettings(ServerSettings):
    """kvmesh failover: discovery, zone health and traffic weights."""

    lkg_file: str = setting("", "where the last known good endpoint sets are persisted")
    health_interval_s: float = setting(1.0, "seconds between health evaluations")
    zones: tuple[str, ...] = setting((), "zones to report even when nothing is registered in them (comma list)")
    zone_weights: str = setting("", "initial zone weights, e.g. 'a=1,b=1' (default: equal over --zones)")
    version_weights: str = setting("", "initial version weights, e.g. 'v1=1' (default: --version only)")
    min_worker_fraction: float = setting(0.5, "a zone is unhealthy below this fraction of worker capacity")
    require_cache_manager: bool = setting(True, "a zone without a passing cache-manager is unhealthy")
    up_observations: int = setting(2, "consecutive healthy observations before a zone comes back")
    up_hold_s: float = setting(2.0, "seconds a zone must look healthy before it comes back")
    min_dwell_s: float = setting(5.0, "minimum seconds a zone stays out once it failed")
    ramp_s: float = setting(30.0, "seconds over which a restored zone's weight ramps back up")
    rewarm_timeout_s: float = setting(
        60.0, "longest a restored zone is held at the ramp floor while other zones re-warm it (0: no hold)"
    )
    start_grace_s: float = setting(
        600.0, "longest a zone not yet healthy since this service started is shown as starting, not unhealthy"
    )
    watch_wait_s: float = setting(5.0, "blocking-query wait of registry watches")
    registry_timeout_s: float = setting(2.0, "timeout of one registry request (beyond the blocking wait)")
    advertise_host: str = setting("", "host others use to reach this instance (default: --host)")
    check_interval_s: float = setting(1.0, "health-check interval of the registry check of this service")
    static_probe_interval_s: float = setting(
        0.5, "seconds between gRPC health probes of static-registry instances (0: trust the file's health)"
    )
    static_probe_timeout_s: float = setting(0.5, "timeout of one health probe of a static-registry instance")
    static_probe_failures: int = setting(3, "consecutive failed probes that make a static-registry instance critical")
    static_probe_successes: int = setting(2, "consecutive good probes that make it passing again")
    rollout_steps: str = setting("5,10,50,100", "canary rollout: the new version's traffic share at each step, %")
    rollout_hold_s: float = setting(300.0, "canary rollout: seconds a step is held (and checked) before the next")
    rollout_check_interval_s: float = setting(30.0, "canary rollout: seconds between checks of a held step")
    rollout_standby_s: float = setting(172800.0, "canary rollout: seconds the old version stays on standby (48 h)")
    rollout_probes: int = setting(8, "canary rollout: prompts in the fixed probe set")
    rollout_probe_prompt_tokens: int = setting(64, "canary rollout: tokens per probe prompt")
    rollout_probe_max_tokens: int = setting(16, "canary rollout: greedy tokens generated per probe")
    rollout_probe_timeout_s: float = setting(10.0, "canary rollout: deadline of one probe request")
    rollout_min_consistency: float = setting(0.99, "canary rollout: least mean output-histogram cosine, [0, 1]")
    rollout_max_latency_regression: float = setting(0.15, "canary rollout: median latency increase that fails")
    rollout_max_memory_diff: float = setting(0.05, "canary rollout: relative KV-pool difference that fails")
    rollout_max_error_rate_increase: float = setting(0.01, "canary rollout: error-rate increase that fails")
