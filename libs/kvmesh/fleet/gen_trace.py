"""``python -m kvmesh.fleet.gen_trace --out PATH [--seed 0 --rate 2 --duration-s 1500]``: write the synthetic
``synthetic.poisson_conversations`` trace as Mooncake JSONL (``readers.write_mooncake``); deterministic under
the seed. Prints one JSON line: the path, requests, and prompt-length figures.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from kvmesh.fleet.readers import write_mooncake
from kvmesh.fleet.synthetic import poisson_conversations


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.fleet.gen_trace", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output .jsonl path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--duration-s", type=float, default=1500.0)
    a = p.parse_args(argv)
    tr = poisson_conversations(seed=a.seed, rate=a.rate, duration_s=a.duration_s)
    n = write_mooncake(tr, a.out)
    lens = np.array([r.input_len for r in tr], dtype=float)
    q = {f"input_p{k}": float(np.percentile(lens, k)) for k in (50, 90, 99)} if n else {}
    print(json.dumps({"out": a.out, "requests": n, "input_mean": float(lens.mean()) if n else 0.0, **q}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
