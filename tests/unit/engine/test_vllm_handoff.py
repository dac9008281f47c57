"""The vLLM adapter's P/D handoff without starting vLLM: the composed KV connector's configuration, which
decode-half params reach vLLM (the rest are computed), and NixlConnector's stats as counters."""

from __future__ import annotations

import json
import time

import pytest

from kvmesh.core.handoff import KvHandoff
from kvmesh.engine.vllm_config import VllmEngineConfig, nixl_importable
from kvmesh.engine.vllm_engine import VllmEngine, add_connector_stats

pytestmark = pytest.mark.unit

PREFILL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "e",
    "remote_request_id": "r-1",
    "remote_host": "localhost",
    "remote_port": 5600,
    "remote_num_tokens": 100,
}


def handoff(params: object, held_for_ms: int = 10_000) -> KvHandoff:
    """A NIXL handoff of `params` (a string as it is, anything else as JSON), held `held_for_ms` from now."""
    return KvHandoff(
        num_blocks=3,
        held_until_unix_ms=int(time.time() * 1000) + held_for_ms,
        engine_params_json=params if isinstance(params, str) else json.dumps(params),
    )


def test_nixl_composes_multiconnector_with_kvmesh_connector_first_match_nixl() -> None:
    cfg = VllmEngineConfig(model="tiny", engine_handoff=True, handoff_hold_ms=7_500, kv_tier_name="t")
    ktc = cfg.kv_transfer_config()
    assert ktc["kv_connector_module_path"] == "kvmesh.engine.vllm_handoff_connector"
    assert ktc["kv_load_failure_policy"] == "recompute"  # a failed NIXL read is computed, never an error
    nixl, kvmesh = ktc["kv_connector_extra_config"]["connectors"]
    assert nixl["kv_connector"] == "NixlConnector" and nixl["kv_buffer_device"] == "cpu"
    assert nixl["kv_connector_extra_config"]["kv_lease_duration"] == 8  # the hold, rounded up to seconds
    assert kvmesh == cfg.kvmesh_connector_config() and kvmesh["kv_connector_extra_config"]["shm_name"] == "t"
    assert "--disable-hybrid-kv-cache-manager" in cfg.cli_args()


def test_without_nixl_the_connector_is_kvmeshs_alone() -> None:
    cfg = VllmEngineConfig(model="tiny", kv_tier_name="t")
    ktc = cfg.kv_transfer_config()
    assert ktc["kv_connector"] == "KvmeshConnector" and ktc["kv_load_failure_policy"] == "recompute"
    assert "--disable-hybrid-kv-cache-manager" not in cfg.cli_args()
    # NIXL alone (no CPU tier): vLLM's connector, no MultiConnector
    only = VllmEngineConfig(model="tiny", kv_connector=False, engine_handoff=True).kv_transfer_config()
    assert only["kv_connector"] == "NixlConnector"


def test_decode_half_params_reach_vllm_only_when_valid_and_held() -> None:
    eng = VllmEngine(VllmEngineConfig(model="tiny", engine_handoff=True))
    assert eng._handoff_params(handoff(PREFILL_PARAMS), prompt_len=100) == PREFILL_PARAMS
    assert eng._handoff_params(handoff(PREFILL_PARAMS, held_for_ms=-1), prompt_len=100) is None  # hold passed
    bad = [
        "not json",
        [1, 2],
        {**PREFILL_PARAMS, "do_remote_prefill": False},
        {**PREFILL_PARAMS, "remote_block_ids": "1,2"},
        {**PREFILL_PARAMS, "remote_block_ids": [[1, -2]]},
        {**PREFILL_PARAMS, "remote_port": "5600"},
        {**PREFILL_PARAMS, "remote_num_tokens": 101},  # more than the prompt: another prompt's handoff
    ]
    for params in bad:
        assert eng._handoff_params(handoff(params), prompt_len=100) is None, params
    counts = eng.handoff_counts()
    assert counts["handoffs_received_total"] == 1 and counts["handoffs_void_total"] == 1
    assert counts["handoffs_refused_total"] == len(bad)
    assert counts["handoffs_fallbacks_total"] == 1 + len(bad)


def test_an_engine_without_nixl_computes_a_nixl_handoff() -> None:
    eng = VllmEngine(VllmEngineConfig(model="tiny"))
    assert not eng.engine_handoff
    assert eng._handoff_params(handoff(PREFILL_PARAMS), prompt_len=100) is None
    assert eng.handoff_counts()["handoffs_fallbacks_total"] == 1
    # a kv-sync handoff is the servicer's (its pull): not the engine's to count
    assert eng._handoff_params(KvHandoff(num_blocks=2), prompt_len=100) is None
    assert eng.handoff_counts()["handoffs_fallbacks_total"] == 1


def test_connector_stats_of_a_multiconnector_become_counters() -> None:
    eng = VllmEngine(VllmEngineConfig(model="tiny", engine_handoff=True))
    report = {
        "KvmeshConnector": {"saved": 3, "loaded_own": 1},
        "NixlConnector": {
            "transfer_duration": [0.002, 0.004],
            "bytes_transferred": [1000, 24],
            "num_kv_expired_reqs": [1],
            "num_failed_transfers": [1],
            "post_duration": [0.1],
        },
    }
    add_connector_stats(eng._stats, report)
    add_connector_stats(eng._stats, {"saved": 2})  # kvmesh's connector alone reports flat counts
    extra = eng.load_report().extra
    assert extra["kv_tier_saved_total"] == 5 and extra["kv_tier_loaded_own_total"] == 1
    assert extra["nixl_transfers_total"] == 2 and extra["nixl_bytes_total"] == 1024
    assert extra["nixl_expired_total"] == 1  # a prefill half's blocks freed by the lease, unread
    assert extra["handoffs_fallbacks_total"] == 1  # the failed transfer: vLLM computed that prompt


@pytest.mark.parametrize("hold_ms, lease_s", [(1, 6), (6_000, 6), (10_000, 10), (10_001, 11)])
def test_lease_is_the_hold_in_whole_seconds(hold_ms: int, lease_s: int) -> None:
    assert VllmEngineConfig(model="tiny", handoff_hold_ms=hold_ms).handoff_lease_s == lease_s


def test_a_worker_hands_off_by_nixl_when_installed_unless_told_not_to() -> None:
    """A prefill or decode vLLM worker runs NIXL when it is installed and not switched off; a `both` worker never
    (it hands nothing over, and NIXL's poller costs half a core when idle)."""
    from kvmesh.services.worker.engine_factory import build_engine, engine_handoff
    from kvmesh.services.worker.settings import WorkerSettings

    for role in ("prefill", "decode"):
        on = build_engine(WorkerSettings(engine="vllm", model="tiny", role=role, handoff_hold_ms=8_000))
        assert engine_handoff(on) == nixl_importable()  # NIXL found at start (`pip install kvmesh[nixl]`)
        assert isinstance(on, VllmEngine) and on.config.handoff_lease_s == 8
    both = WorkerSettings(engine="vllm", model="tiny", role="both")
    assert not engine_handoff(build_engine(both))
    off = WorkerSettings(engine="vllm", model="tiny", role="decode", vllm_nixl=False)
    assert not engine_handoff(build_engine(off))
    sim = build_engine(WorkerSettings(engine="sim", cpu_tier_mb=0))  # no tier: no shared memory to leave
    assert not engine_handoff(sim)  # the simulated engine hands over by kv-sync
