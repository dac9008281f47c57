"""Reading a service's Prometheus /metrics page in tests."""

from __future__ import annotations

import re
import urllib.request


def metric(port: int, name: str, label: str = "") -> float:
    """Sum of the samples of `name` (optionally with `label` in its label set) on a /metrics page."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    pat = re.compile(rf"^{name}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for lab, v in pat.findall(body) if label in lab)
