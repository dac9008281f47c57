"""The emulated inter-zone link of the failover bench: every byte one zone sends another crosses a
`kvmesh.bench.delay_proxy` in the root namespace (added delay each way, a bandwidth cap per connection and
direction), since the namespaces forward nothing between zones and there is no `tc netem` here.

Inside its namespace each zone's cache-manager listens on `CM_PORT` and its i-th worker's KvSyncService on
`KVSYNC_PORT + i` (fixed: nothing else lives in the namespace, and a restarted zone comes back on the same
addresses, so the proxies, made before any zone starts, keep pointing at the right place). For every ordered
pair (X dials Y) there is one proxy to Y's cache-manager and one per Y worker, each listening on X's host
address (the one X's namespace reaches). `cache_manager_flags(X)` makes X's cache-manager follow every other
zone through its proxy, rewrite the other zones' kv-sync addresses to the proxies X's workers dial
(`--kvsync-address-map`), and, with a byte budget, replicate its hot prefixes into them. `cut`/`heal`
partition the zones from each other (clients still reach both).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.bench.delay_proxy import ProxyProcess
from kvmesh.bench.netns import Zone

CM_PORT = 47100
KVSYNC_PORT = 47000


class InterZoneLinks:
    """See the module docstring."""

    def __init__(self, zones: Sequence[Zone], workers_per_zone: int, delay_ms: float, rate: float) -> None:
        self.zones = list(zones)
        self.workers = workers_per_zone
        self.cm: dict[tuple[str, str], ProxyProcess] = {}
        self.kvsync: dict[tuple[str, str, int], ProxyProcess] = {}
        try:
            for x in self.zones:
                for y in self.zones:
                    if x.name == y.name:
                        continue
                    self.cm[(x.name, y.name)] = ProxyProcess(f"{y.ns_ip}:{CM_PORT}", delay_ms, x.host_ip, rate)
                    for i in range(workers_per_zone):
                        target = f"{y.ns_ip}:{KVSYNC_PORT + i}"
                        self.kvsync[(x.name, y.name, i)] = ProxyProcess(target, delay_ms, x.host_ip, rate)
        except BaseException:
            self.close()
            raise

    def cache_manager_flags(self, zone: Zone, replication_bytes_per_s: float) -> list[str]:
        flags = ["--port", str(CM_PORT)]
        for (x, y), proxy in self.cm.items():
            if x == zone.name:
                flags += ["--follow-zone", f"{y}={proxy.address}"]
        by_name = {z.name: z for z in self.zones}
        for (x, y, i), proxy in self.kvsync.items():
            if x == zone.name:
                flags += ["--kvsync-address-map", f"{by_name[y].ns_ip}:{KVSYNC_PORT + i}={proxy.address}"]
        if replication_bytes_per_s > 0:
            flags += ["--replication-bytes-per-s", str(replication_bytes_per_s), "--replication-interval-s", "1"]
        return flags

    @staticmethod
    def worker_flags(i: int) -> list[str]:
        return ["--kvsync-port", str(KVSYNC_PORT + i)]

    def _all(self) -> list[ProxyProcess]:
        return [*self.cm.values(), *self.kvsync.values()]

    def cut(self) -> None:
        """Partition the zones from each other (every connection through the link dies)."""
        for p in self._all():
            p.cut()

    def heal(self) -> None:
        for p in self._all():
            p.heal()

    def close(self) -> None:
        for p in self._all():
            p.close()
