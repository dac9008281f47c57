"""Where a model's files are: `model` if given, else the tiny local test model built by
`scripts/build_tiny_model.py` (`$KVMESH_HOME/models/tiny-llama`, else `~/.cache/kvmesh/models/tiny-llama`)."""

from __future__ import annotations

import os
from pathlib import Path


def resolve_model_dir(model: str) -> Path | None:
    """The first candidate folder holding a `tokenizer.json`, or None."""
    cands = [Path(model)] if model else []
    if os.environ.get("KVMESH_HOME"):
        cands.append(Path(os.environ["KVMESH_HOME"]) / "models" / "tiny-llama")
    cands.append(Path.home() / ".cache" / "kvmesh" / "models" / "tiny-llama")
    for c in cands:
        if (c / "tokenizer.json").is_file():
            return c
    return None
