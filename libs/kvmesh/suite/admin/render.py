"""Text views of the admin CLI's documents (`kvmesh.suite.admin.views`): pure functions of the data, so what an
operator reads is unit-tested. Times are arguments (`now`, seconds since the epoch); nothing here reads a
clock or a terminal.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: a `kvmesh top` frame on a terminal


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, numbers right-aligned, two spaces apart; no trailing spaces."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in rows) and bool(rows) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def ago(since: float, now: float) -> str:
    """``42s``, ``7m``, ``3h``, ``2d`` since `since`; ``-`` when unknown (0)."""
    if since <= 0:
        return "-"
    s = max(0.0, now - since)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def workers(doc: Mapping[str, Any]) -> str:
    head = (
        f"router {doc['router']}  prefill weight {doc['prefill_weight']:.2f}  "
        f"decode weight {doc['decode_weight']:.2f}  workers {len(doc['workers'])}"
    )
    rows = [
        [
            w["id"],
            w["zone"],
            w["role"] or None,
            w["state"],
            w["circuit"],
            w["running"],
            w["waiting"],
            f"{pct(w['kv_usage'])} {w['kv_blocks_used']}/{w['kv_blocks_total']}",
            w["in_flight"],
            w["selections_total"],
            w["decode_latency_p95_ms"],
            pct(w["prefix_hit_rate"]),
        ]
        for w in doc["workers"]
    ]
    headers = ["WORKER", "ZONE", "ROLE", "STATE", "CIRCUIT", "RUN", "WAIT", "KV USE", "IN-FLIGHT", "SELECTED"]
    return head + "\n" + table([*headers, "P95 MS", "HIT"], rows)


WEIGHTS_HEAD = {
    "set": "traffic weights set",
    "rollback": "traffic weights rolled back",
    "get": "traffic weights in force",
}


def weights(doc: Mapping[str, Any]) -> str:
    """The weights in force as the split of traffic they make (stored normalised: a weight is its share), after
    a line saying whether they were just set, rolled back or read."""
    rows = [["zone", k, v] for k, v in doc["zone_weights"].items()]
    rows += [["version", k, v] for k, v in doc["version_weights"].items()]
    if not rows:
        return "no traffic weights set"
    head = WEIGHTS_HEAD.get(str(doc.get("action", "get")), "traffic weights")
    split = "; ".join(
        f"{kind}s " + ", ".join(f"{n} {100 * w:.1f}%" for n, w in doc[f"{kind}_weights"].items())
        for kind in ("zone", "version")
        if doc[f"{kind}_weights"]
    )
    return f"{head}: {split}\n" + table(["KIND", "NAME", "WEIGHT"], [[k, n, f"{w:.3f}"] for k, n, w in rows])


def zones(doc: Mapping[str, Any], now: float) -> str:
    head = f"failover {doc['failover']}  registry {'reachable' if doc['registry_reachable'] else 'UNREACHABLE'}"
    rows = [
        [
            z["zone"],
            _zone_state(z),
            "-" if z["weight"] is None else f"{z['weight']:.3f}",
            z["routers"],
            z["cache_managers"],
            z["workers"],
            "-" if z.get("routable") is None else z["routable"],
            ago(z["since"], now),
            z["reason"] or _pending(z) or _unroutable(z) or "-",
        ]
        for z in doc["zones"]
    ]
    head_row = ["ZONE", "STATE", "WEIGHT", "ROUTERS", "CACHE-MGRS", "WORKERS", "ROUTABLE", "FOR", "REASON"]
    text = table(head_row, rows)
    versions = ", ".join(f"{v} {w:.3f}" for v, w in doc["version_weights"].items()) or "-"
    return f"{head}\n{text}\nversion weights: {versions}"


def _zone_state(z: Mapping[str, Any]) -> str:
    """healthy, STARTING (not yet healthy since the failover service started: engines loading, services coming
    up), UNHEALTHY, UNROUTABLE (healthy to the failover service, but its router has no worker in rotation:
    every one drained, unhealthy or with its circuit open), or re-warming (restored, held at the ramp floor until
    other zones re-warm it)."""
    if not z["healthy"]:
        return "STARTING" if z.get("starting") else "UNHEALTHY"
    if z.get("routable") == 0:
        return "UNROUTABLE"
    return "re-warming" if z.get("rewarm_hold") else "healthy"


def _unroutable(z: Mapping[str, Any]) -> str:
    if z.get("routable") != 0:
        return ""
    drained = f": {z['draining']} draining" if z.get("draining") else ""
    return f"no worker in rotation{drained}"


def _pending(z: Mapping[str, Any]) -> str:
    pending = z.get("rewarm_pending_from") or []
    return f"re-warm pending from {', '.join(pending)}" if pending else ""


def rollout(doc: Mapping[str, Any], now: float) -> str:
    r = doc["rollout"]
    if r is None:
        return f"failover {doc['failover']}: no rollout was ever started"
    head = (
        f"rollout {r['old_version']} -> {r['new_version']}: {r['phase']}, new version at {pct(r['new_share'])} "
        f"(at most {pct(r['max_new_share'])})"
    )
    checked = r["consistency"] > 0 or r["failed_checks"]  # a check always measures consistency or fails it
    checks = (
        "last check: none yet"
        if not checked
        else (
            f"last check: consistency {r['consistency']:.4f}, latency {r['latency_regression']:+.1%}, "
            f"memory {r['memory_diff']:+.1%}, failed: {', '.join(r['failed_checks']) or '-'}"
        )
    )
    rows = [[ago(e["at"], now), e["kind"], e["message"]] for e in r["events"]]
    standby = f"\nold version on standby for {ago(now, r['standby_until'])}" if r["standby_until"] > now else ""
    return f"{head}\n{checks}{standby}\n" + table(["AGO", "EVENT", "MESSAGE"], rows)


def index(doc: Mapping[str, Any]) -> str:
    p = doc["warming_policy"]
    lines = [
        f"cache-manager {doc['cache_manager']}  model {doc['model'] or '-'}  block size {doc['block_size']}",
        table(
            ["WORKERS", "BLOCKS", "PAIRS", "HIT RATIO", "BATCHES", "GAPS", "RESYNCS", "WARMINGS"],
            [
                [
                    doc["workers"],
                    doc["blocks"],
                    doc["pairs"],
                    pct(doc["hit_ratio"]),
                    doc["batches_total"],
                    doc["gaps_total"],
                    doc["resyncs_total"],
                    doc["warming_actions_total"],
                ]
            ],
        ),
        f"warming: hot at {p['hot_threshold']} hits in {p['window_s']:g}s, up to {p['max_replicas']} replicas, "
        f"{p['capacity']} prefixes kept warm, LFU weight {p['lfu_weight']:.2f}",
    ]
    top = doc["top_prefixes"]
    if top:
        rows = [[t["key"], t["blocks"], t["tokens"], t["window_count"], t["total"], t["tenant"] or "-"] for t in top]
        lines.append(f"top {len(top)} prefixes in the last {p['window_s']:g}s:")
        lines.append(table(["PREFIX", "BLOCKS", "TOKENS", "IN WINDOW", "TOTAL", "TENANT"], rows))
    else:
        lines.append(f"no prefix queried in the last {p['window_s']:g}s")
    replication = doc.get("replication") or []
    if replication:
        rows = [
            [
                r["zone"],
                r["prefixes"],
                r["blocks"],
                r["bytes_total"],
                r["failures_total"],
                f"{r['budget_bytes_per_s'] / 1e6:g}",
                "yes" if r["pending"] else "no",
            ]
            for r in replication
        ]
        lines.append(f"hot prefixes replicated from zone {doc['zone'] or '-'}:")
        head = ["INTO ZONE", "PREFIXES", "BLOCKS", "BYTES", "FAILURES", "BUDGET MB/S", "PENDING"]
        lines.append(table(head, rows))
    followed = doc.get("followed_zones") or []
    if followed:
        rows = [
            [
                z["zone"],
                z["address"],
                "yes" if z["connected"] else "no",
                z["revision"],
                f"{z['lag_s'] * 1e3:.1f}",
                z["blocks"],
                z["snapshots"],
                z["resumes"],
            ]
            for z in followed
        ]
        lines.append(f"zones followed by zone {doc['zone'] or '-'}:")
        head = ["ZONE", "ADDRESS", "CONNECTED", "REVISION", "LAG MS", "BLOCKS", "SNAPSHOTS", "RESUMES"]
        lines.append(table(head, rows))
    return "\n".join(lines)


def _part(frame: Mapping[str, Any], key: str) -> Mapping[str, Any] | str | None:
    """A frame's part, or its error text, or None when the part was not asked for."""
    part = frame.get(key)
    if isinstance(part, Mapping) and "error" in part:
        return f"{key}: {part['error']}"
    return part


def top_frame(frame: Mapping[str, Any], number: int, of: int | None) -> str:
    """One `kvmesh top` frame: the header, the workers table, the zones and the index summary; a part that
    failed shows its error in its place (the view goes on)."""
    now = float(frame["time"])
    stamp = time.strftime("%H:%M:%S", time.gmtime(now))
    out = [f"kvmesh top  {stamp} UTC  frame {number}" + (f"/{of}" if of else "")]
    w = _part(frame, "workers")
    out.append(w if isinstance(w, str) else workers(w) if w else "workers: no router")
    z = _part(frame, "zones")
    if isinstance(z, str):
        out.append(z)
    elif z:
        out.append(zones(z, now))
    i = _part(frame, "index")
    if isinstance(i, str):
        out.append(i)
    elif i:
        out.append(
            f"index: {i['workers']} workers, {i['blocks']} blocks, {i['pairs']} pairs, hit ratio "
            f"{pct(i['hit_ratio'])}, {i['gaps_total']} gaps, {i['resyncs_total']} resyncs"
        )
    return "\n".join(out) + "\n"


def warming(doc: Mapping[str, Any]) -> str:
    head = "warming policy set" if doc.get("action") == "set" else "warming policy in force"
    return (
        f"{head} (cache-manager {doc['cache_manager']}): hot at {doc['hot_threshold']} hits in {doc['window_s']:g}s, "
        f"up to {doc['max_replicas']} replicas, {doc['capacity']} prefixes kept warm, "
        f"LFU weight {doc['lfu_weight']:.2f}"
    )


def guardrails(doc: Mapping[str, Any], now: float) -> str:
    if not doc["enabled"]:
        return f"router {doc['router']}: no guardrails (router.guardrails in the suite file, or --guardrails PATH)"
    changed = doc.get("changed")
    how = "" if changed is None else ("reloaded: new rules in force; " if changed else "reloaded: unchanged; ")
    return (
        f"router {doc['router']}: {how}{doc['rules']} guardrail rules from {doc['path']} "
        f"(version {doc['version']}, loaded {ago(doc['loaded_at'], now)} ago)"
    )


def _action(d: Mapping[str, Any]) -> str:
    parts = ([f"add {d['add']}"] if d["add"] else []) + ([f"drain {', '.join(d['remove'])}"] if d["remove"] else [])
    pools = d.get("pools") or {}
    parts += [f"{c['worker_id'] or c['address']} {c['from']} -> {c['to']}" for c in pools.get("role_changes", [])]
    return " and ".join(parts) or "hold"


def _reason(d: Mapping[str, Any]) -> str:
    """The scaling's reason, then the pool split's."""
    return "; ".join(r for r in (d["reason"], (d.get("pools") or {}).get("reason", "")) if r)


def _pool_line(p: Mapping[str, Any]) -> str:
    return (
        f"  pools: prefill {p['prefill']} serving / {p['desired_prefill']} desired "
        f"(forecast {p['forecast_prefill_tokens_per_s']:.0f} prompt tokens/s), decode {p['decode']} serving / "
        f"{p['desired_decode']} desired (forecast {p['forecast_decode_streams']:.1f} streams)"
    )


def plan(doc: Mapping[str, Any], now: float) -> str:
    """Per zone: the forecaster and its figures, the last step's decision, then the recent decisions."""
    out = [f"planner {doc['planner']}  actuator {doc['actuator']}  step every {doc['interval_s']:g}s"]
    for z in doc["zones"]:
        mae = ", ".join(f"{k} {v:.2f}" for k, v in z["forecast_mae"].items()) or "none yet (needs a held-out day)"
        out.append(
            f"zone {z['zone']}: forecaster {z['forecaster']} (held-out MAE: {mae}); "
            f"{z['history_buckets']} buckets of {z['bucket_s']:g}s recorded"
        )
        if z["error"]:
            out.append(f"  last step failed: {z['error']}")
        last = z["last"]
        if last is None:
            out.append("  no planning step yet")
        else:
            ahead = " ".join(f"{x:.1f}" for x in z["forecast"][:12]) or "-"
            out.append(
                f"  {ago(last['at'], now)} ago: {last['serving']} serving, {last['starting']} starting, "
                f"{last['queued']} queued; sized for {last['forecast_rps']:.3f} req/s -> desired {last['desired']}: "
                f"{_action(last)}{' (' + _reason(last) + ')' if _reason(last) else ''}"
            )
            if last.get("pools"):
                out.append(_pool_line(last["pools"]))
            out.append(f"  forecast, requests per {z['bucket_s']:g}s bucket: {ahead}")
        if z["decisions"]:
            rows = [
                [
                    ago(d["at"], now),
                    d["desired"],
                    d["serving"],
                    d["starting"],
                    d["queued"],
                    _action(d),
                    _reason(d) or "-",
                ]
                for d in z["decisions"][-10:]
            ]
            out.append(table(["AGO", "DESIRED", "SERVING", "STARTING", "QUEUED", "ACTION", "REASON"], rows))
    return "\n".join(out)
