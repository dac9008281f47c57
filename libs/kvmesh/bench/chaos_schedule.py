"""The chaos campaign's fault schedule: pure, and the same for the same seed (`random.Random(seed)`).

A schedule is a list of `Fault` (start time, kind, target, how long, parameters), sorted by start. Kinds are
drawn in rounds: every kind of `KINDS` once per round, in a seeded order, so even a short run injects each
kind (its first round, with short gaps) and in a long one the kinds' counts differ by one at most (a
30-minute run of ~250 faults injects each of the 16 kinds 15 or 16 times).

Kinds and what they do (the runner's `kvmesh.bench.chaos_runner` carries them out):

* ``kill``: SIGKILL of one process, restarted on the same address after `duration_s`.
* ``stop``: SIGSTOP of one process, SIGCONT after `duration_s` (a process hung, then back).
* ``term``: SIGTERM of one process (a graceful stop), restarted once it has exited.
* ``version_skew``: a worker stopped (SIGTERM) and started again with another version label while the routers
  still hold its old view; after `duration_s` it is rolled back the same way.
* ``oom_kill``: a worker put in a memory cgroup whose limit is below what it is about to use, so that the
  kernel's OOM killer kills it (SIGKILL); restarted after `duration_s`.
* ``link_cut``: the inter-zone link down for `duration_s`.
* ``link_delay``: the link restarted with `params["delay_ms"]` each way for `duration_s`, then as before.
* ``link_cap``: the link restarted with a bandwidth cap of `params["bytes_per_s"]` per connection and
  direction for `duration_s`, then as before.
* ``link_flap``: the link cut and healed every `params["period_s"]` for `duration_s`.
* ``rogue_drain``: DrainWorker of every worker of a zone's router with the planner's identity (the router
  must refuse past its drain floor with PERMISSION_DENIED naming drain_floor); what was drained is undrained
  after `duration_s`.
* ``pool_full``: long sessions sent straight to one worker until its KV pool is full, for `duration_s`.
* ``checkpoint_full``: a zone's checkpoint store full for `duration_s` (Redis at its memory limit with no
  eviction, or the checkpoint directory's tmpfs filled), then freed.
* ``tier_corrupt``: one byte flipped in a published block of a worker's CPU tier (its shared memory); a
  kv-sync pull of that block must then fail its integrity check.
* ``pull_peer_kill``: a kv-sync pull of a worker's tier over a slow link (gRPC through a bandwidth-capped
  proxy), the worker SIGKILLed while the bytes are on their way, restarted after `duration_s`: the pull must
  fail closed, with only verified blocks delivered.
* ``lease_expire``: a lease on a worker's blocks outlived by its puller (stalled until `duration_s` less the
  lease's `params["ttl_ms"]` past the lease's end, while the worker keeps serving): the read must then be
  refused as expired.
* ``burst``: the campaign's arrival rate x `params["factor"]` for `duration_s`.

Process targets are ``<zone>/<service>``: ``a/router``, ``a/cache-manager``, ``a/failover``, ``a/planner``,
``a/worker-0``... and the first zone's ``redis`` (its cache-manager's checkpoint store; the other zone's
cache-manager checkpoints to files). The kinds in `WORKER_ONLY_KINDS` target a worker.

The overlap rule (why every request always has somewhere to go): at most `MAX_ACTIVE` faults at once; of
those at most one is a process fault (`PROCESS_KINDS`) and at most one touches the link (`LINK_KINDS`). So
at every instant at least one zone has every process up, and a client that follows both zones' failover
services always has a whole zone to be served by. A fault that would break the rule starts when the fault in
its way has ended; at run time a process fault also waits for the previous one's restart, however long.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PROCESS_KINDS = ("kill", "stop", "term", "version_skew", "oom_kill", "pull_peer_kill")
WORKER_ONLY_KINDS = ("version_skew", "oom_kill", "pull_peer_kill", "pool_full", "tier_corrupt", "lease_expire")
LINK_KINDS = ("link_cut", "link_delay", "link_cap", "link_flap")
OTHER_KINDS = ("rogue_drain", "pool_full", "checkpoint_full", "tier_corrupt", "lease_expire", "burst")
KINDS = PROCESS_KINDS + LINK_KINDS + OTHER_KINDS
MAX_ACTIVE = 2
SERVICES = ("router", "cache-manager", "failover", "planner")
REDIS = "redis"  # the first zone's checkpoint store, a process target of that zone
# (low, high) seconds a fault of each kind lasts; a term's restart follows the graceful exit at once
DURATION_S = {
    "kill": (1.0, 4.0),
    "stop": (1.0, 5.0),
    "term": (0.0, 0.0),
    "version_skew": (3.0, 8.0),
    "oom_kill": (1.0, 4.0),
    "pull_peer_kill": (1.0, 3.0),
    "link_cut": (2.0, 6.0),
    "link_delay": (3.0, 8.0),
    "link_cap": (3.0, 8.0),
    "link_flap": (3.0, 6.0),
    "rogue_drain": (2.0, 5.0),
    "pool_full": (3.0, 8.0),
    "checkpoint_full": (3.0, 8.0),
    "tier_corrupt": (0.0, 0.0),
    "lease_expire": (1.0, 2.0),
    "burst": (3.0, 6.0),
}
# how long a term may take to exit (a service drains for up to its 10 s grace) and come back: the rule holds
# its process fault that long (the runner also waits for a restart that outlasts its schedule)
TERM_HOLD_S = 6.0
# how long a worker's restart is held for: a version skew's two restarts, an OOM kill's death and restart
WORKER_RESTART_S = 3.0


@dataclass(frozen=True)
class Fault:
    t: float  # seconds after the campaign's start
    kind: str
    target: (
        str  # "<zone>/<service>" (process), "<zone>/worker-<i>" (pool_full), "<zone>" (rogue_drain), "link", "traffic"
    )
    duration_s: float
    params: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def end(self) -> float:
        """When the rule stops counting it as active."""
        hold = self.duration_s
        if self.kind == "term":
            hold = TERM_HOLD_S
        elif self.kind == "version_skew":  # a graceful stop and a start on each side of its time
            hold += 2 * WORKER_RESTART_S
        elif self.kind in ("oom_kill", "pull_peer_kill"):
            hold += WORKER_RESTART_S
        return round(self.t + hold, 2)  # on the schedule's 10 ms grid, as its starts are: no float-edge overlap

    def line(self) -> str:
        """One line for the report: time, kind, target, how long, parameters (enough to read a replay)."""
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"t={self.t:7.2f}s {self.kind:<15} {self.target:<18} for {self.duration_s:5.2f}s {extra}".rstrip()

    def as_dict(self) -> dict[str, Any]:
        return {"t": self.t, "kind": self.kind, "target": self.target, "duration_s": self.duration_s, **self.params}


def process_targets(zones: Sequence[str], workers_per_zone: int) -> list[str]:
    """Every process of the suite: each zone's services and workers, and the first zone's Redis."""
    out = [f"{z}/{s}" for z in zones for s in (*SERVICES, *(f"worker-{i}" for i in range(workers_per_zone)))]
    return [*out, f"{zones[0]}/{REDIS}"]


def _group(kind: str) -> str:
    return "process" if kind in PROCESS_KINDS else "link" if kind in LINK_KINDS else kind


def allowed(active: Sequence[Fault], kind: str) -> bool:
    """Whether a fault of `kind` may start while `active` run (the module's overlap rule)."""
    if len(active) >= MAX_ACTIVE:
        return False
    group = _group(kind)
    return group not in ("process", "link") or all(_group(f.kind) != group for f in active)


def _draw(rng: random.Random, kind: str, t: float, zones: Sequence[str], workers: int) -> Fault:
    low, high = DURATION_S[kind]
    duration = round(rng.uniform(low, high), 2)
    params: dict[str, Any] = {}
    zone = rng.choice(list(zones))
    if kind in WORKER_ONLY_KINDS:
        target = f"{zone}/worker-{rng.randrange(workers)}"
    elif kind in PROCESS_KINDS:
        target = rng.choice(process_targets(zones, workers))
    elif kind in ("rogue_drain", "checkpoint_full"):
        target = zone
    elif kind == "burst":
        target = "traffic"
    else:
        target = "link"
    if kind == "link_delay":
        params["delay_ms"] = round(rng.uniform(20.0, 200.0), 1)
    elif kind == "link_cap":
        params["bytes_per_s"] = int(rng.choice((64e3, 256e3, 1e6, 4e6)))
    elif kind == "link_flap":
        params["period_s"] = round(rng.uniform(0.4, 1.2), 2)
    elif kind == "version_skew":
        params["version"] = "chaos-skew"
    elif kind == "lease_expire":
        params["ttl_ms"] = 500
    elif kind == "burst":
        params["factor"] = 10
    return Fault(round(t, 2), kind, target, duration, params)


def make_schedule(
    seed: int,
    duration_s: float,
    zones: Sequence[str] = ("a", "b"),
    workers_per_zone: int = 2,
    warmup_s: float = 5.0,
    settle_s: float = 20.0,
    mean_gap_s: float = 6.0,
) -> list[Fault]:
    """Faults starting in [warmup_s, duration_s - settle_s), each ending by duration_s - settle_s; kinds in
    rounds of one of each, in a seeded order; the first round with gaps of at most the window's share per
    kind, then a new fault every `mean_gap_s` on average (exponential gaps), the overlap rule kept.
    ValueError when the window cannot hold one fault of every kind."""
    rng = random.Random(seed)
    window_end = duration_s - settle_s
    bag = list(KINDS)
    rng.shuffle(bag)
    first_round = True
    first_gap = (window_end - warmup_s) / len(KINDS)
    faults: list[Fault] = []
    t = warmup_s
    while True:
        if not bag:  # a new round: every kind once more
            bag = list(KINDS)
            rng.shuffle(bag)
            first_round = False
        kind = bag.pop(0)
        fault = _draw(rng, kind, t, zones, workers_per_zone)
        start = round(t, 2)
        while not allowed([f for f in faults if f.t <= start < f.end], kind):
            start = round(min(f.end for f in faults if f.t <= start < f.end) + 0.01, 2)  # past it, rounded
        fault = Fault(round(start, 2), fault.kind, fault.target, fault.duration_s, fault.params)
        if fault.end > window_end:
            missing = set(KINDS) - {f.kind for f in faults}
            if missing:
                raise ValueError(
                    f"duration_s {duration_s} leaves {window_end - warmup_s:.0f}s of fault window: too short for "
                    f"one fault of each kind ({', '.join(sorted(missing))} left out); run longer"
                )
            break
        faults.append(fault)
        # while a kind has not had its fault, gaps are short enough for all of them to fit a short window
        short = first_round and bag
        t = start + (rng.uniform(0.5, 1.0) * min(mean_gap_s, first_gap) if short else rng.expovariate(1 / mean_gap_s))
    return faults


def counts(faults: Sequence[Fault]) -> dict[str, int]:
    """Faults per kind, every kind named (0 when absent)."""
    out = dict.fromkeys(KINDS, 0)
    for f in faults:
        out[f.kind] += 1
    return out
