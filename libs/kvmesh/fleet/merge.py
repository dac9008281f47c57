"""Attach a second kvmesh evaluation (e.g. a tuned YAML profile) to a report directory and re-render.

    python -m kvmesh.fleet.merge MAIN_DIR TUNED_DIR PROFILE_YAML "description" [ANALYSIS.md]

Both evaluations must share the load scale (same trace, fleet, seed and SLO: round-robin's capacity is
deterministic); the tuned run's ``kvmesh`` entry is stored as ``kvmesh_tuned`` in ``MAIN_DIR/raw.json``.
An optional Markdown file becomes the report's "Analysis" section; the notes are recomputed from the trace.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from kvmesh.fleet.evaluate import absolute_slo_evidence, build_notes, load_trace
from kvmesh.fleet.metrics import Slo
from kvmesh.fleet.report import compact, write_report
from kvmesh.fleet.sim import FleetConfig
from kvmesh.fleet.studies import concurrent_long_study


def main(argv: list[str]) -> int:
    main_dir, tuned_dir, profile, desc = Path(argv[0]), Path(argv[1]), argv[2], argv[3]
    ev = json.loads((main_dir / "raw.json").read_text())
    tu = json.loads((tuned_dir / "raw.json").read_text())
    a, b = ev["results"]["load_scale"], tu["results"]["load_scale"]
    if not math.isclose(a, b, rel_tol=1e-9):
        print(f"load scales differ: {a} vs {b}", file=sys.stderr)
        return 1
    ev["kvmesh_tuned"] = {
        "profile": profile,
        "description": desc,
        "results": tu["results"]["kvmesh"],
        "probes": tu["capacities"]["kvmesh"]["probes"],
    }
    if len(argv) > 4:
        ev["analysis_md"] = Path(argv[4]).read_text()
    full = load_trace(ev["trace"] + ("+spread" if ev.get("spread_arrivals") else ""))
    cfg = FleetConfig(**{k: v for k, v in ev["config"].items() if k != "slo"}, slo=Slo(**ev["config"]["slo"]))
    ev["absolute_slo"] = absolute_slo_evidence(full, cfg)
    ev["notes"] = build_notes(full, cfg, ev["absolute_slo"])
    if "concurrent" in ev:  # the 32-concurrent study with the tuned profile too (a few seconds)
        c = ev["concurrent"]
        extra = concurrent_long_study(["kvmesh"], cfg, c["workers"], c["clients"], 1, profile)
        c["runs"]["kvmesh_tuned"] = extra["runs"]["kvmesh"]
    write_report(ev, main_dir)
    (main_dir / "raw.json").write_text(json.dumps(compact(ev)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
