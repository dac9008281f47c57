"""scripts/check_boundaries.py passes on the real tree and names the file:line of each kind of planted violation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "check_boundaries.py"

# A minimal tree that obeys every rule: each import here is allowed.
CLEAN = {
    "libs/kvmesh/__init__.py": "",
    "libs/kvmesh/core/errors.py": "class Error(Exception): ...\n",
    "libs/kvmesh/util.py": "import socket\n",  # not pure: may use sockets
    "libs/kvmesh/v1/__init__.py": "",
    "libs/kvmesh/v1/a_pb2.py": "from google.protobuf import descriptor\nfrom kvmesh.v1 import b_pb2\n",
    "libs/kvmesh/v1/b_pb2.py": "import grpc\n",
    "libs/kvmesh/routing/__init__.py": "from kvmesh.core.errors import Error\nfrom . import types\n",
    "libs/kvmesh/routing/types.py": "import dataclasses\n",
    "libs/kvmesh/engine/__init__.py": "",
    "libs/kvmesh/engine/sim/__init__.py": "",
    "libs/kvmesh/engine/sim/core.py": "from kvmesh.engine.sim import pool\n",
    "libs/kvmesh/engine/sim/pool.py": "import collections\n",
    "libs/kvmesh/engine/sim/driver.py": "import asyncio\nimport time\n",
    "libs/kvmesh/wire/__init__.py": "",
    "libs/kvmesh/wire/proto_events.py": "from kvmesh.v1 import a_pb2\n",
    "libs/kvmesh/wire/zmq_sub.py": "import zmq\n",  # not a pure codec
    "services/__init__.py": "",
    "services/a/__init__.py": "",
    "services/a/core.py": "from kvmesh.services.a import other\nfrom kvmesh.util import socket\nimport kvmesh.v1\n",
    "services/a/other.py": "",
    "services/b/__init__.py": "",
    "services/b/core.py": "import asyncio\nimport time\n",
}

# (file, its new text, the line reported, what the report names)
PLANTED = [
    ("libs/kvmesh/util.py", "import socket\nfrom kvmesh.services.b import core\n", 2, "libs never import services"),
    ("libs/kvmesh/v1/b_pb2.py", "import grpc\nimport kvmesh.core.errors\n", 2, "generated code imports only itself"),
    ("services/a/other.py", "\nfrom kvmesh.services.b import core\n", 2, "no service imports another"),
    ("services/a/other.py", "\n\nfrom kvmesh.services import b\n", 3, "no service imports another"),
    ("libs/kvmesh/routing/types.py", "import dataclasses\n\n\ndef f():\n    import time\n", 5, "imports time ("),
    ("libs/kvmesh/routing/types.py", "from datetime import datetime\n", 1, "imports datetime.datetime"),
    ("libs/kvmesh/routing/types.py", "from kvmesh.v1 import a_pb2\n", 1, "imports kvmesh.v1.a_pb2 (pure"),
    ("libs/kvmesh/core/errors.py", "from ..rpc import errors\n", 1, "imports kvmesh.rpc.errors"),
    ("libs/kvmesh/engine/sim/pool.py", "import collections\nimport asyncio\n", 2, "imports asyncio (pure"),
    ("libs/kvmesh/routing/types.py", "from kvmesh.util import x\n", 1, "via kvmesh.util -> socket (pure"),
    ("libs/kvmesh/wire/proto_events.py", "from kvmesh.v1 import a_pb2\nimport grpc.aio\n", 2, "grpc.aio (pure codec"),
]


def run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60, check=False
    )


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_real_tree_passes() -> None:
    result = run_check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_clean_minimal_tree_passes(tmp_path: Path) -> None:
    write_tree(tmp_path, CLEAN)
    result = run_check(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pure_wire_codecs_may_be_absent(tmp_path: Path) -> None:
    write_tree(tmp_path, {k: v for k, v in CLEAN.items() if "/wire/" not in k})
    assert run_check(tmp_path).returncode == 0


@pytest.mark.parametrize(("rel", "text", "line", "named"), PLANTED)
def test_planted_violation_fails_and_names_file_line(
    tmp_path: Path, rel: str, text: str, line: int, named: str
) -> None:
    write_tree(tmp_path, {**CLEAN, rel: text})
    result = run_check(tmp_path)
    assert result.returncode == 1
    reports = result.stdout.splitlines()
    assert len(reports) == 1, reports
    assert reports[0].startswith(f"{rel}:{line}: "), reports
    assert named in reports[0], reports


@pytest.mark.parametrize(
    ("rel", "text", "line"),
    [
        ("libs/kvmesh/util.py", "import socket\nfrom kvmesh.bench import router\n", 2),
        ("libs/kvmesh/routing/types.py", "def f():\n    import kvmesh.fleet.sim\n", 2),
        ("services/b/core.py", "from kvmesh.fuzzing import http\n", 1),
    ],
)
def test_serving_code_importing_a_tool_fails(tmp_path: Path, rel: str, text: str, line: int) -> None:
    write_tree(tmp_path, {**CLEAN, rel: text})
    reports = run_check(tmp_path).stdout.splitlines()
    assert reports == [f"{rel}:{line}: {reports[0].split(': ', 1)[1]}"], reports
    assert reports[0].endswith("(serving code never imports a tool)"), reports


def test_a_tool_may_import_serving_code(tmp_path: Path) -> None:
    write_tree(tmp_path, {**CLEAN, "libs/kvmesh/bench/__init__.py": "from kvmesh.routing import types\n"})
    assert run_check(tmp_path).returncode == 0


def test_planted_cycle_fails_naming_both_edges(tmp_path: Path) -> None:
    # routing already imports core.errors; core importing routing back closes a ring of two packages
    write_tree(tmp_path, {**CLEAN, "libs/kvmesh/core/config.py": "\nfrom kvmesh.routing import types\n"})
    result = run_check(tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "cycle: kvmesh.core -> kvmesh.routing (libs/kvmesh/core/config.py:2 imports kvmesh.routing.types)",
        "cycle: kvmesh.routing -> kvmesh.core (libs/kvmesh/routing/__init__.py:1 imports kvmesh.core.errors.Error)",
    ]


def test_planted_cycle_through_three_packages_fails(tmp_path: Path) -> None:
    files = {
        **CLEAN,
        "libs/kvmesh/a/__init__.py": "from kvmesh.b import x\n",
        "libs/kvmesh/b/__init__.py": "from kvmesh.c import y\n",
        "libs/kvmesh/c/__init__.py": "def f():\n    from kvmesh.a import z\n",
    }
    write_tree(tmp_path, files)
    lines = run_check(tmp_path).stdout.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "cycle: kvmesh.a -> kvmesh.b",
        "cycle: kvmesh.b -> kvmesh.c",
        "cycle: kvmesh.c -> kvmesh.a",
    ], lines


def test_a_chain_without_a_ring_is_no_cycle(tmp_path: Path) -> None:
    files = {**CLEAN, "libs/kvmesh/a/__init__.py": "from kvmesh.b import x\n", "libs/kvmesh/b/__init__.py": ""}
    write_tree(tmp_path, files)
    assert run_check(tmp_path).returncode == 0
