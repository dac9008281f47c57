"""The router's own in-flight accounting, so decisions between two load reports see each other.

For each request r assigned to worker w at time t_r with n_r = prompt - overlap_w new tokens:

    inflight_prefill_tokens(w) = Σ n_r          over r on w, still before its first token, with t_r > T_w
    inflight_decode_tokens(w)  = Σ prompt_r     over r on w, not finished, with t_r > T_w
    inflight_kv_blocks(w)      = Σ ceil(n_r / block_size)   same set
    inflight_requests(w)       = #{r on w, not finished}     (all of them, for the anti-herding tie-break)

With R router replicas splitting the traffic, each replica sees only about 1/R of the work assigned since
the last report; `InflightTracker(replicas=R)` multiplies the three unreported sums by R in `apply`, an
estimate of what all replicas together added (the report then corrects it). `inflight_requests` is not scaled.

T_w is the timestamp of w's last load report (`on_report`): work assigned before it is already inside the
report's `prefill_tokens_queued` / `decode_tokens_active`, so it is not counted twice. A request counts in
decode load from its assignment on, because it will hold that KV while it decodes. Pure: times are passed in.
`PendingPulls` is the same for KV pulls: the pulls hinted to each worker that may still run.

A report can arrive after an assignment yet have been taken before the request reached the worker (the
request is still on the wire, or in the worker's queue to its engine); it would then erase that request from
both sums until the next report, and the next decisions herd onto the worker that looks idle. So `apply`
never lets the report plus the in-flight sum fall below this router's own outstanding work on w:

    inflight_prefill_tokens(w) = max(the unreported sum above × R, own_prefill(w) - prefill_tokens_queued(w))
    inflight_decode_tokens(w)  = max(the unreported sum above × R, own_decode(w) - decode_tokens_active(w))
    inflight_kv_blocks(w)      = max(the unreported sum above × R, own_blocks(w) - kv_usage(w) × kv_blocks_total(w))

where own_* are the same sums over every request of this router on w, reported or not.

The other way round, a report also lags the work that ended: requests of this router already in w's last
report that have since passed their first token or finished still weigh in it until the next report, so w
looks busier than it is and the next decisions herd onto the others. Their part (done_*(w), reset by each
newer report) is taken off the report, never more than the report holds:

    unreported_prefill(w) = Σ n_r over unreported r × R - min(done_prefill(w), prefill_tokens_queued(w))
    (likewise decode and KV blocks), and the max(…, own_* - report) above on top. The count of those that
    finished is `ended_requests(w)` (= done_requests(w), at most the report's running + waiting): a report
    of 4 running taken before 3 of them finished still says 4 until the next one, and the cost's
    interference term (`kvmesh.routing.scorers.cost`) takes them off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvmesh.routing.types import WorkerView


@dataclass(slots=True)
class _Entry:
    worker: str
    assigned_at: float
    prefill_tokens: int
    kv_tokens: int
    kv_blocks: int
    prefilling: bool = True
    reported: bool = False


@dataclass(slots=True)
class _Sums:
    prefill: int = 0  # unreported requests only
    decode: int = 0
    blocks: int = 0
    requests: int = 0
    own_prefill: int = 0  # every outstanding request of this router, reported or not
    own_decode: int = 0
    own_blocks: int = 0
    done_prefill: int = 0  # reported requests' work that ended after the last report (prefill / whole)
    done_decode: int = 0
    done_blocks: int = 0
    done_requests: int = 0


class InflightTracker:
    """Per-worker sums of this router's outstanding requests; O(1) per event, O(k) per report."""

    def __init__(self, replicas: int = 1) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.replicas = replicas
        self._entries: dict[str, _Entry] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._sums: dict[str, _Sums] = {}
        self._report_ts: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def worker_of(self, request_id: str) -> str | None:
        e = self._entries.get(request_id)
        return e.worker if e else None

    def assign(
        self, request_id: str, worker: str, prefill_tokens: int, kv_tokens: int, block_size: int, now: float
    ) -> None:
        """Count request `request_id` on `worker` (re-assigning a known id moves it: a retry or migration)."""
        if request_id in self._entries:
            self.finish(request_id)
        bs = max(block_size, 1)
        e = _Entry(worker, now, max(prefill_tokens, 0), max(kv_tokens, 0), -(-max(prefill_tokens, 0) // bs))
        e.reported = now <= self._report_ts.get(worker, float("-inf"))
        self._entries[request_id] = e
        self._by_worker.setdefault(worker, set()).add(request_id)
        s = self._sums.setdefault(worker, _Sums())
        s.requests += 1
        s.own_prefill += e.prefill_tokens
        s.own_decode += e.kv_tokens
        s.own_blocks += e.kv_blocks
        if not e.reported:
            s.prefill += e.prefill_tokens
            s.decode += e.kv_tokens
            s.blocks += e.kv_blocks

    def first_token(self, request_id: str) -> None:
        """The request finished prefill: its prefill tokens leave the worker's in-flight prefill."""
        e = self._entries.get(request_id)
        if e is None or not e.prefilling:
            return
        e.prefilling = False
        s = self._sums[e.worker]
        s.own_prefill -= e.prefill_tokens
        if e.reported:
            s.done_prefill += e.prefill_tokens
        else:
            s.prefill -= e.prefill_tokens

    def finish(self, request_id: str) -> None:
        """The request ended (done, failed, cancelled): remove it everywhere. Unknown ids are ignored."""
        e = self._entries.pop(request_id, None)
        if e is None:
            return
        self._by_worker[e.worker].discard(request_id)
        s = self._sums[e.worker]
        s.requests -= 1
        if e.prefilling:
            s.own_prefill -= e.prefill_tokens
        s.own_decode -= e.kv_tokens
        s.own_blocks -= e.kv_blocks
        if e.reported:
            if e.prefilling:
                s.done_prefill += e.prefill_tokens
            s.done_decode += e.kv_tokens
            s.done_blocks += e.kv_blocks
            s.done_requests += 1
        else:
            self._unreport(s, e)

    @staticmethod
    def _unreport(s: _Sums, e: _Entry) -> None:
        if e.prefilling:
            s.prefill -= e.prefill_tokens
        s.decode -= e.kv_tokens
        s.blocks -= e.kv_blocks

    def on_report(self, worker: str, report_ts: float) -> None:
        """A load report taken at `report_ts` arrived: work assigned at or before it is now reported."""
        if report_ts <= self._report_ts.get(worker, float("-inf")):
            return
        self._report_ts[worker] = report_ts
        s = self._sums.setdefault(worker, _Sums())
        s.done_prefill = s.done_decode = s.done_blocks = s.done_requests = 0  # the new report no longer holds them
        for rid in self._by_worker.get(worker, ()):
            e = self._entries[rid]
            if not e.reported and e.assigned_at <= report_ts:
                e.reported = True
                self._unreport(s, e)

    def forget_worker(self, worker: str) -> list[str]:
        """Drop a worker (left the fleet); returns the request ids that were on it."""
        ids = list(self._by_worker.pop(worker, ()))
        for rid in ids:
            self._entries.pop(rid, None)
        self._sums.pop(worker, None)
        self._report_ts.pop(worker, None)
        return ids

    def apply(self, views: Iterable[WorkerView]) -> None:
        """Write the current sums into the views' `inflight_*` fields."""
        zero = _Sums()
        k = self.replicas
        for v in views:
            s = self._sums.get(v.id, zero)
            q, d, b = v.prefill_tokens_queued, v.decode_tokens_active, round(v.kv_usage * v.kv_blocks_total)
            v.inflight_prefill_tokens = max(s.prefill * k - min(s.done_prefill, q), s.own_prefill - q)
            v.inflight_decode_tokens = max(s.decode * k - min(s.done_decode, d), s.own_decode - d)
            v.inflight_kv_blocks = max(s.blocks * k - min(s.done_blocks, b), s.own_blocks - b)
            v.inflight_requests = s.requests
            v.ended_requests = min(s.done_requests, v.running + v.waiting)


@dataclass(frozen=True, slots=True)
class PendingPull:
    """A pull this router hinted to a worker: the prompt's `blocks` leading blocks from `source`, the hint void
    after `expires` (the caller's clock); `expires_unix_ms`: the same instant as the hint said it (wall clock,
    taken once), so a request that joins the pull gets the very hint the first one got."""

    source: str
    blocks: int
    expires: float
    expires_unix_ms: int = 0


class PendingPulls:
    """Pulls hinted and possibly still running, per worker, keyed by the index hash of the last block pulled
    (a chained hash names its whole prefix). A later request whose prompt has that hash at position
    `blocks − 1` is priced on the worker as holding those blocks in its tier (the first request pays the
    pull) and gets the same hint again, so the worker joins the running pull: one pull per prefix and worker.
    Entries leave when their hint expires; at most `per_worker` are kept per worker (the oldest go)."""

    def __init__(self, per_worker: int = 256) -> None:
        self.per_worker = per_worker
        self._by_worker: dict[str, dict[int, PendingPull]] = {}

    def add(self, worker: str, last_hash: int, pull: PendingPull) -> None:
        pulls = self._by_worker.setdefault(worker, {})
        pulls.pop(last_hash, None)
        pulls[last_hash] = pull
        while len(pulls) > self.per_worker:
            del pulls[next(iter(pulls))]

    def covering(self, worker: str, hashes: Sequence[int] | npt.NDArray[np.uint64], now: float) -> PendingPull | None:
        """The longest unexpired pull to `worker` of a prefix of `hashes` (None if none)."""
        pulls = self._by_worker.get(worker)
        if not pulls:
            return None
        best: PendingPull | None = None
        for h, p in list(pulls.items()):
            if p.expires <= now:
                del pulls[h]
            elif (
                0 < p.blocks <= len(hashes)
                and int(hashes[p.blocks - 1]) == h
                and (best is None or p.blocks > best.blocks)
            ):
                best = p
        return best

    def forget_worker(self, worker: str) -> None:
        self._by_worker.pop(worker, None)
