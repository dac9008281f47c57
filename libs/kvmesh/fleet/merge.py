"""Attach a second kvmesh evaluation (e.g. a tuned YAML profile) to a report directory and re-render.

    python -m kvmesh.fleet.merge MAIN_DIR TUNED_DIR PROFILE_YAML "description"

Both evaluations must share the load scale (same trace, fleet, seed and SLO: round-robin's capacity is
deterministic); the tuned run's ``kvmesh`` entry is stored as ``kvmesh_tuned`` in ``MAIN_DIR/raw.json``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from kvmesh.fleet.report import write_report


def main(argv: list[str]) -> int:
    main_dir, tuned_dir, profile, desc = Path(argv[0]), Path(argv[1]), argv[2], argv[3]
    ev = json.loads((main_dir / "raw.json").read_text())
    tu = json.loads((tuned_dir / "raw.json").read_text())
    a, b = ev["results"]["load_scale"], tu["results"]["load_scale"]
    if not math.isclose(a, b, rel_tol=1e-9):
        print(f"load scales differ: {a} vs {b}", file=sys.stderr)
        return 1
    ev["kvmesh_tuned"] = {"profile": profile, "description": desc, "results": tu["results"]["kvmesh"],
                          "probes": tu["capacities"]["kvmesh"]["probes"]}
    (main_dir / "raw.json").write_text(json.dumps(ev) + "\n")
    write_report(ev, main_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
