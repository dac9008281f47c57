"""The tiny local test model (no model hub here): built once by scripts/build_tiny_model.py, idempotent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tiny_model() -> str:
    """The tiny model's folder (built on first use; the script leaves an up-to-date folder as it is)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_tiny_model.py")],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.stdout.strip().splitlines()[-1]
