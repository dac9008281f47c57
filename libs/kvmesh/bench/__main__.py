"""``python -m kvmesh.bench <name> [args...]``, name one of `BENCHES`; ``--help`` lists them. What each measures,
its command and its figures: the index at the top of docs/benchmarks.md (a unit test keeps it complete).

Each prints one JSON line.

Dispatches to ``kvmesh.bench.<name>.main(argv)`` (``-`` in a name becomes ``_``); a benchmark is added by
creating that module.
"""

from __future__ import annotations

import importlib
import sys

BENCHES = (
    "index",
    "worker",
    "router",
    "grpc-hop",
    "fleet",
    "fleet-live",
    "failover",
    "oversize",
    "balance",
    "pd",
    "kvsync",
    "connector",
    "fuzz",
    "vllm-serve",
    "zone-follow",
    "autoscale",
    "shared-index",
    "recovery",
    "mutation",
    "chaos",
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = f"usage: python -m kvmesh.bench <{'|'.join(BENCHES)}> [args...]"
    if args[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\nEach benchmark prints one JSON line; `python -m kvmesh.bench NAME --help` gives its flags.")
        print("What each measures, its command and its figures: docs/benchmarks.md (the index at the top).")
        return 0
    if not args or args[0] not in BENCHES:
        print(usage, file=sys.stderr)
        return 2
    name = f"kvmesh.bench.{args[0].replace('-', '_')}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        print(f"benchmark {args[0]!r} is not implemented yet", file=sys.stderr)
        return 2
    result = module.main(args[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
