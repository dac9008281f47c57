"""A lease on a peer's blocks -> the KV connector's kv_transfer_params (pure), and the engine's tier flags."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.kvplane.kvsync.client import Lease
from kvmesh.kvplane.kvsync.tier import SlotRef
from kvmesh.kvplane.pulls import leased_prefix, leased_pull
from kvmesh.kvplane.vllm_connector.plan import parse_pull, pull_params
from kvmesh.services.worker.engine_factory import vllm_tier_fields
from kvmesh.services.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit


def _digests(n: int) -> list[bytes]:
    return [hashlib.sha256(f"b{i}".encode()).digest() for i in range(n)]


def _lease(found: list[bool]) -> Lease:
    refs = [SlotRef(i, 2) if ok else None for i, ok in enumerate(found)]
    return Lease("cpu", _digests(len(found)), refs, lease_until_ns=123_456_789, deadline=0.0)


def test_the_connector_reads_the_params_as_the_leased_prefix() -> None:
    lease = _lease([True, True, False, True])
    params = pull_params(leased_pull("kvmesh-a-1", lease.lease_until_ns, leased_prefix(lease)))
    assert params is not None
    pull = parse_pull(params)  # the connector's own parser
    assert pull is not None
    assert pull.shm_name == "kvmesh-a-1" and pull.lease_until_ns == 123_456_789
    # only the leading held blocks: block 3 is held but follows a gap, so it is not claimable
    assert pull.digests == tuple(_digests(2)) == tuple(leased_prefix(lease))


def test_a_lease_without_a_leading_block_is_no_pull() -> None:
    lease = _lease([False, True])
    assert leased_pull("kvmesh-a-1", lease.lease_until_ns, leased_prefix(lease)) is None


def test_tier_flags_reach_the_vllm_engine_config() -> None:
    on = vllm_tier_fields(WorkerSettings(service_id="w7", cpu_tier_mb=64))
    assert on == {"worker_id": "w7", "kv_connector": True, "kv_tier_bytes": 64 << 20, "pull_staging_bytes": 64 << 20}
    off = vllm_tier_fields(WorkerSettings(cpu_tier_mb=0, pull_staging_mb=2))
    assert off["kv_connector"] is False and off["kv_tier_bytes"] == 0 and off["pull_staging_bytes"] == 2 << 20
