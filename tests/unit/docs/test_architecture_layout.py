"""docs/architecture.md's layout table names every package under libs/kvmesh and every service, nothing that does
not exist, and its "may import" column is what the code imports (read with scripts/check_boundaries.py's Tree)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
ROW_PATH = re.compile(r"^`((?:libs/kvmesh|services)/[^`]+)`$")


def layout_rows() -> dict[str, set[str]]:
    """{path named in the Layout section's table: its "may import" packages}, for paths under libs/kvmesh or
    services (a folder as `x/`, a module as `x.py`)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = ROW_PATH.match(cells[1]) if len(cells) == 4 else None
        if match:
            assert match[1] not in rows, f"{match[1]} is in the layout table twice"
            rows[match[1]] = {p.strip() for p in cells[3].split(",")} - {"—", ""}
    return rows


def on_disk() -> set[str]:
    """Every package and top-level module under libs/kvmesh, and every service, as the table names them."""
    lib = ROOT / "libs" / "kvmesh"
    out = {f"libs/kvmesh/{p.name}/" for p in lib.iterdir() if (p / "__init__.py").is_file()}
    out |= {f"libs/kvmesh/{p.name}" for p in lib.glob("*.py") if p.name != "__init__.py"}
    out |= {f"services/{p.name}/" for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file()}
    return out


def boundaries() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_boundaries", ROOT / "scripts" / "check_boundaries.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def package_of(module: str) -> str:
    """`kvmesh.a.b` → `libs/kvmesh/a/`; `kvmesh.services.x.y` → `services/x/`; the root package → ``."""
    parts = module.split(".")
    if parts[1:2] == ["services"]:
        return f"services/{parts[2]}/" if len(parts) > 2 else ""
    return f"libs/kvmesh/{parts[1]}/" if len(parts) > 1 else ""


def test_every_package_and_service_is_in_the_table_and_nothing_else() -> None:
    named, present = set(layout_rows()), on_disk()
    assert not present - named, f"missing from docs/architecture.md's layout table: {sorted(present - named)}"
    assert not named - present, f"in docs/architecture.md's layout table but not in the code: {sorted(named - present)}"


def test_may_import_is_what_the_code_imports() -> None:
    tree = boundaries().Tree(ROOT)
    imported: dict[str, set[str]] = {}
    for module, imports in tree.imports.items():
        source = package_of(module)
        for imp in imports:
            target = tree.resolve(imp.target)
            dest = package_of(target) if target else ""
            if source and dest and dest != source:
                imported.setdefault(source, set()).add(dest.rstrip("/").rsplit("/", 1)[1])
    wrong = {
        path: {"table": sorted(allowed), "code": sorted(imported.get(path, set()))}
        for path, allowed in layout_rows().items()
        if allowed != imported.get(path, set())
    }
    assert not wrong, f"docs/architecture.md's 'may import' differs from the code: {wrong}"
