"""The `kvmesh` CLI run as a real process for tests, with its own `KVMESH_HOME`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def kvmesh_cli(
    home: Path, *args: str, timeout: float = 180.0, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m kvmesh.suite.cli ARGS` with `KVMESH_HOME=home`, none of the caller's other ``KVMESH_*`` variables
    (only `KVMESH_REQUIRE_NATIVE`) and `env` added; output captured as text, bounded by `timeout`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_") or k == "KVMESH_REQUIRE_NATIVE"}
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.suite.cli", *args],
        env={**base, "KVMESH_HOME": str(home), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
