"""`kvmesh workers|rebalance|drain|undrain|zones|weights|rollout|index|warming|guardrails|planner|top`: the
operator's commands over the suite's admin gRPC APIs (the router's RouterAdminService, the failover service's
weights and zone health, the cache-manager's statistics and warming policy, the planner's plan).
`register(subparsers)` adds them to the `kvmesh` command.

Every command takes the target flags of `kvmesh.suite.admin.target` (default: the local suite and its operator
credential; `--zone NAME` picks the suite's zone) and ``--json`` (one JSON document on stdout instead of the
text view). Exit codes: 0 done,
1 the call failed (e.g. INVALID_ARGUMENT, NOT_FOUND), 2 usage (no target, unreadable credential),
3 denied (the caller lacks role admin), 4 a service unreachable. docs/operations.md shows each command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.suite.admin import calls, render
from kvmesh.suite.admin.target import EXIT_USAGE, AdminError, Target, add_arguments, resolve, resolve_all
from kvmesh.v1 import cache_manager_pb2

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def _emit(args: argparse.Namespace, doc: dict[str, Any], text: str) -> int:
    print(json.dumps(doc, indent=1) if args.json else text, flush=True)
    return 0


async def _workers(args: argparse.Namespace) -> int:
    doc = await calls.list_workers(_target(args, "router"), args.timeout)
    return _emit(args, doc, render.workers(doc))


async def _rebalance(args: argparse.Namespace) -> int:
    doc = await calls.rebalance(_target(args, "router"), args.timeout, args.prefill_weight, args.decode_weight)
    return _emit(args, doc, f"weights in force: prefill {doc['prefill_weight']:.3f}, decode {doc['decode_weight']:.3f}")


async def _drain(args: argparse.Namespace) -> int:
    on = args.command == "drain"
    try:
        doc = await calls.drain(_target(args, "router"), args.timeout, args.worker, on, getattr(args, "force", False))
    except AdminError as exc:
        if on and "FAILED_PRECONDITION" in str(exc):  # the last worker of its zone in rotation
            zone = f" --zone {args.zone}" if getattr(args, "zone", None) else ""
            raise AdminError(f"{exc}: `kvmesh drain {args.worker}{zone} --force`", exc.exit_code) from None
        raise
    text = f"{args.worker}: draining, {doc['in_flight']} in flight" if on else f"{args.worker}: back in rotation"
    return _emit(args, doc, text)


async def _zones(args: argparse.Namespace) -> int:
    doc = await calls.zones(_target(args, "failover"), args.timeout, resolve_all(args, "router"))
    return _emit(args, doc, render.zones(doc, time.time()))


def _weight_map(field: str, text: str | None) -> dict[str, float]:
    from kvmesh.discovery.registration import parse_weights  # the home of the "a=1,b=2" syntax

    if not text:
        return {}
    try:
        return parse_weights(field, text)
    except InvalidArgument as exc:
        raise AdminError(f"--{field}: {exc}", EXIT_USAGE) from exc


async def _weights(args: argparse.Namespace) -> int:
    zw, vw = _weight_map("zones", args.zones), _weight_map("versions", args.versions)
    if args.rollback and (zw or vw):
        raise AdminError("--rollback takes no --zones/--versions", EXIT_USAGE)
    doc = await calls.weights(_target(args, "failover"), args.timeout, zw, vw, args.rollback)
    return _emit(args, doc, render.weights(doc))


async def _rollout(args: argparse.Namespace) -> int:
    if bool(args.start) != bool(args.old):
        raise AdminError("--start NEW and --old OLD go together", EXIT_USAGE)
    doc = await calls.rollout(_target(args, "failover"), args.timeout, args.start or "", args.old or "")
    return _emit(args, doc, render.rollout(doc, time.time()))


async def _index(args: argparse.Namespace) -> int:
    doc = await calls.index(_target(args, "cache-manager"), args.timeout, args.top)
    return _emit(args, doc, render.index(doc))


async def _warming(args: argparse.Namespace) -> int:
    fields = {k: getattr(args, k) for k in ("hot_threshold", "window_s", "max_replicas", "capacity", "lfu_weight")}
    for name, value in fields.items():  # 0 would read as "keep": refused here rather than silently ignored
        if value is not None and not value > 0:
            raise AdminError(f"--{name.replace('_', '-')}: must be > 0, got {value}", EXIT_USAGE)
    policy = cache_manager_pb2.WarmingPolicy(**{k: v for k, v in fields.items() if v is not None})
    doc = await calls.warming(_target(args, "cache-manager"), args.timeout, policy)
    return _emit(args, doc, render.warming(doc))


async def _guardrails(args: argparse.Namespace) -> int:
    doc = await calls.guardrails(_target(args, "router"), args.timeout, args.reload)
    return _emit(args, doc, render.guardrails(doc, time.time()))


async def _planner(args: argparse.Namespace) -> int:
    doc = await calls.planner(_target(args, "planner"), args.timeout)
    return _emit(args, doc, render.plan(doc, time.time()))


async def _part(fetch: Coroutine[Any, Any, dict[str, Any]]) -> tuple[dict[str, Any], int]:
    try:
        return await fetch, 0
    except AdminError as exc:
        return {"error": str(exc)}, exc.exit_code


async def _frame(targets: dict[str, Target | None], timeout: float) -> tuple[dict[str, Any], int]:
    """One `top` frame: the parts fetched together; a part that fails holds its error (exit code kept)."""
    fetchers: dict[str, Callable[[Target, float], Coroutine[Any, Any, dict[str, Any]]]] = {
        "workers": calls.list_workers,
        "zones": calls.zones,
        "index": calls.index,
    }
    names = {"workers": "router", "zones": "failover", "index": "cache-manager"}
    parts = {k: targets[names[k]] for k in fetchers}
    asked = [k for k, t in parts.items() if t is not None]
    got = await asyncio.gather(*(_part(fetchers[k](parts[k], timeout)) for k in asked))  # type: ignore[arg-type]
    frame: dict[str, Any] = {"time": time.time(), **{k: doc for k, (doc, _) in zip(asked, got, strict=True)}}
    return frame, next((code for _, code in got if code), 0)


async def _top(args: argparse.Namespace) -> int:
    targets = {s: resolve(args, s, required=s == "router") for s in ("router", "failover", "cache-manager")}
    n = args.iterations if args.iterations is not None else (1 if args.json else None)
    tty = sys.stdout.isatty() and not args.json
    frames: list[dict[str, Any]] = []
    code, i = 0, 0
    while n is None or i < n:
        if i:
            await asyncio.sleep(args.interval)  # the refresh period of the view
        frame, code = await _frame(targets, args.timeout)
        i += 1
        if args.json:
            frames.append(frame)
        else:
            text = render.top_frame(frame, i, n)
            print((render.CLEAR + text) if tty else text, flush=True)
    if args.json:
        print(json.dumps({"interval_s": args.interval, "frames": frames}, indent=1), flush=True)
    return code


def _target(args: argparse.Namespace, service: str) -> Target:
    t = resolve(args, service)
    assert t is not None  # required
    return t


def _run(handler: Handler) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(handler(args))
        except AdminError as exc:
            print(f"kvmesh {args.command}: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            return 0

    return run


def register(sub: Any) -> None:
    """Adds the admin commands to `kvmesh`'s subparsers (`argparse._SubParsersAction`)."""

    def add(name: str, help_text: str, handler: Handler) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(func=_run(handler))
        return p

    add("workers", "the router's workers: state, load, KV use, circuit, selections", _workers)
    p = add("rebalance", "set the routing cost weights (normalised by the router)", _rebalance)
    p.add_argument("--prefill-weight", type=float, required=True, help="weight of prefill cost (alpha), >= 0")
    p.add_argument("--decode-weight", type=float, required=True, help="weight of decode load, >= 0")
    p = add("drain", "stop routing new requests to WORKER (in-flight requests finish)", _drain)
    p.add_argument("worker", metavar="WORKER")
    p.add_argument(
        "--force", action="store_true", help="drain it even when it is the last worker of its zone in rotation"
    )
    add("undrain", "put WORKER back into rotation", _drain).add_argument("worker", metavar="WORKER")
    add("zones", "zone health and the traffic weights in force (failover service)", _zones)
    p = add("weights", "read, set or roll back traffic weights between zones and versions", _weights)
    p.add_argument("--zones", metavar="Z=W,...", help="zone weights, e.g. a=0.9,b=0.1")
    p.add_argument("--versions", metavar="V=W,...", help="version weights, e.g. v1=0.95,v2=0.05")
    p.add_argument("--rollback", action="store_true", help="restore the weights before the last change")
    p = add("rollout", "start a canary-checked version rollout, or show the current one and its events", _rollout)
    p.add_argument("--start", metavar="NEW", help="the version to roll out (5 %% -> 10 %% -> 50 %% -> 100 %%)")
    p.add_argument("--old", metavar="OLD", help="the version it replaces (kept on standby after the promotion)")
    p = add("index", "the cache-manager's index statistics, top prefixes and warming policy", _index)
    p.add_argument("--top", type=int, default=10, help="most-queried prefixes to show (default 10, at most 1000)")
    p = add("warming", "read or set the cache-manager's warming policy (options left out keep their value)", _warming)
    p.add_argument("--hot-threshold", type=int, help="hits within the window that make a prefix hot")
    p.add_argument("--window-s", type=float, help="sliding window of the prefix statistics, seconds")
    p.add_argument("--max-replicas", type=int, help="most workers a hot prefix is warmed onto")
    p.add_argument("--capacity", type=int, help="most prefixes kept warm")
    p.add_argument("--lfu-weight", type=float, help="frequency against recency in the keep-warm score, (0, 1]")
    p = add(
        "guardrails", "the router's output guardrail rules in force; --reload reads the rule files now", _guardrails
    )
    p.add_argument(
        "--reload", action="store_true", help="read the rule files now (a bad file: the error, old rules stay)"
    )
    add("planner", "the planner's forecast, worker counts and recent decisions per zone", _planner)
    p = add("top", "a live view of the fleet: workers, zones, index, refreshed", _top)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between frames (default 2)")
    p.add_argument("--iterations", type=int, help="frames to show, then exit (default: until Ctrl-C; 1 with --json)")
