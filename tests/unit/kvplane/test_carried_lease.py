"""A lease carried with a pull (a replicated prefix's, taken by its cache-manager next to the source): how it
travels (`kvmesh.wire.proto`, a wall-clock end) and when the pulling worker may read under it
(`kvmesh.kvplane.pulls.held_lease`): only for the very blocks it needs, with the margin left to run."""

from __future__ import annotations

import hashlib

from kvmesh.core.pull import CarriedLease, KvPull
from kvmesh.kvplane.kvsync.client import Lease
from kvmesh.kvplane.kvsync.tier import SlotRef
from kvmesh.kvplane.pulls import CARRIED_LEASE_MARGIN_S, EXPIRED, MISMATCH, carry, held_lease
from kvmesh.v1 import worker_pb2
from kvmesh.wire.proto import held_lease_from_proto, held_lease_to_proto, pull_from_proto, pull_to_proto

D = tuple(hashlib.sha256(bytes([i])).digest() for i in range(4))
RID = b"r" * 16


def _carried(expires_unix_ms: int = 1_000_000_000_000) -> CarriedLease:
    return CarriedLease(D, ((3, 2), (7, 4), (1, 6), None), RID, expires_unix_ms)


def test_a_carried_lease_round_trips_through_the_pull_hint() -> None:
    pull = KvPull(source_address="10.0.0.1:7000", region="cpu", num_blocks=4, lease=_carried())
    hint = pull_to_proto(pull)
    assert hint.HasField("lease") and [b.found for b in hint.lease.blocks] == [True, True, True, False]
    assert pull_from_proto(worker_pb2.KvPullHint.FromString(hint.SerializeToString())) == pull
    assert pull_from_proto(pull_to_proto(KvPull(source_address="a:1"))).lease is None  # unset stays unset


def test_a_malformed_carried_lease_is_dropped_not_trusted() -> None:
    msg = held_lease_to_proto(_carried())
    del msg.blocks[-1]  # one block fewer than digests: which slot is whose is unknown
    assert held_lease_from_proto(msg) is None


def test_carry_moves_the_end_from_the_monotonic_to_the_wall_clock() -> None:
    lease = Lease("cpu", list(D), [SlotRef(3, 2), None, None, None], 123, deadline=50.0, region_id=RID)
    c = carry(lease, wall_now=1_000.0, mono_now=40.0)  # 10 s left on this host's monotonic clock
    assert c.expires_unix_ms == 1_010_000
    assert c.slots == ((3, 2), None, None, None) and c.digests == D and c.region_id == RID


def test_held_lease_ends_a_margin_early_on_this_host_s_clocks() -> None:
    lease, why = held_lease(_carried(1_010_000), D[:3], "cpu", wall_now=1_000.0, mono_now=500.0)
    assert lease is not None and why == ""
    assert lease.deadline == 500.0 + 10.0 - CARRIED_LEASE_MARGIN_S
    assert lease.lease_until_ns == int(lease.deadline * 1e9)  # what a same-host shared-memory read checks
    assert [(r.slot, r.generation) if r else None for r in lease.refs] == [(3, 2), (7, 4), (1, 6)]
    assert (lease.region, lease.digests, lease.region_id, lease.prefix) == ("cpu", list(D[:3]), RID, 3)


def test_a_pull_may_skip_the_leading_blocks_its_engine_holds() -> None:
    lease, _ = held_lease(_carried(1_010_000), D[1:3], "cpu", wall_now=1_000.0, mono_now=0.0)
    assert lease is not None and [(r.slot, r.generation) for r in lease.refs if r] == [(7, 4), (1, 6)]


def test_other_blocks_are_a_mismatch_and_an_ended_lease_is_expired() -> None:
    other = hashlib.sha256(b"other").digest()
    for digests in ((other,), (D[0], D[2]), (), (D[2], D[3], other)):
        assert held_lease(_carried(1_010_000), digests, "cpu", 1_000.0, 0.0) == (None, MISMATCH), digests
    ends = 1_000_000 + int(CARRIED_LEASE_MARGIN_S * 1000)  # exactly the margin left: no time to read
    assert held_lease(_carried(ends), D[:2], "cpu", 1_000.0, 0.0) == (None, EXPIRED)
    assert held_lease(_carried(ends + 1), D[:2], "cpu", 1_000.0, 0.0)[0] is not None
