"""The zones this cache-manager follows (`--follow-zone ZONE=ADDRESS`): one `IndexFollower` each.

Each follower keeps its zone's copy in `CacheCore.zones[zone]` (a `ReplicaIndex`, never the local index: a
remote delta cannot touch a local entry), resumed from its last applied revision after a break; its channel
is opened as the cache-manager's other outgoing channels are (TLS and the cache-manager's bearer token), and
the followed cache-manager must agree on block size and salt model; it pings every 2 s (`ZONE_LINK_OPTIONS`),
so a zone lost with its link shows as not connected within about 3 s. `matches` answers for every followed
zone (FindMatches with `all_zones`); `stats` is GetStats' `followed_zones`; the lag of every live message
goes to `kvmesh_cache_zone_follow_lag_seconds{zone}`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.cachemgr.core import CacheCore
from kvmesh.core.config import key_map
from kvmesh.core.errors import InvalidArgument
from kvmesh.replica.follower import IndexFollower
from kvmesh.rpc.channel import ZONE_LINK_OPTIONS, ChannelSecurity
from kvmesh.services.cache_manager import metrics as m
from kvmesh.v1 import cache_manager_pb2 as pb


def parse_follow_zones(specs: Sequence[str], own_zone: str) -> dict[str, str]:
    """`ZONE=ADDRESS` entries → {zone: address}; each zone once, never this cache-manager's own."""
    out = key_map("follow_zone", specs, "ZONE=HOST:PORT")
    if own_zone in out:
        raise InvalidArgument("follow_zone", f"zone {own_zone!r} is this cache-manager's own (--zone)")
    return out


@dataclass(frozen=True, slots=True)
class ZoneMatch:
    """A followed zone's worker match: `total` leading blocks, `tier` of them past its GPU run."""

    zone: str
    worker: str
    total: int
    tier: int


class ZoneFollowers:
    """Followers of the zones in `core.zones` (see the module docstring)."""

    def __init__(
        self, core: CacheCore, addresses: dict[str, str], security: ChannelSecurity, expect: tuple[int, str]
    ) -> None:
        self.followers = {
            z: IndexFollower(
                a,
                security,
                expect,
                core.zones[z],
                on_message=functools.partial(self._observed, z),
                channel_options=ZONE_LINK_OPTIONS,
            )
            for z, a in addresses.items()
        }

    def start(self) -> None:
        for f in self.followers.values():
            f.start()

    async def stop(self) -> None:
        for f in self.followers.values():
            await f.stop()

    def _observed(self, zone: str, msg: pb.WatchIndexResponse, first: bool, lag: float | None) -> None:
        f = self.followers[zone]
        if first:
            m.ZONE_STREAMS.labels(zone, "resumed" if msg.resumed else "snapshot").inc()
        if lag is not None:
            m.ZONE_LAG.labels(zone).observe(lag)
        m.ZONE_CONNECTED.labels(zone).set(1 if f.connected else 0)
        m.ZONE_REVISION.labels(zone).set(f.replica.revision)

    def matches(self, hashes: Sequence[int] | np.ndarray) -> list[ZoneMatch]:
        """Every followed zone's matches of `hashes` (from its copy as last applied)."""
        out = []
        for z, f in self.followers.items():
            found = f.replica.lookup(hashes)
            out += [ZoneMatch(z, w, n, n - found.gpu.get(w, n)) for w, n in found.total.items() if n > 0]
        return out

    def stats(self) -> list[pb.GetStatsResponse.FollowedZone]:
        """GetStats' `followed_zones` (refreshing the per-zone gauges)."""
        out = []
        for z, f in sorted(self.followers.items()):
            r = f.replica
            blocks = r.index.num_entries()
            m.ZONE_BLOCKS.labels(z).set(blocks)
            m.ZONE_CONNECTED.labels(z).set(1 if f.connected else 0)
            out.append(
                pb.GetStatsResponse.FollowedZone(
                    zone=z,
                    address=f.address,
                    revision=r.revision,
                    epoch=r.epoch,
                    connected=f.connected,
                    lag_s=f.last_lag_s,
                    blocks=blocks,
                    snapshots=f.snapshots,
                    resumes=f.resumes,
                )
            )
        return out
