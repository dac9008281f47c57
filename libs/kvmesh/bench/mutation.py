"""Mutation testing of the pure packages: ``python -m kvmesh.bench mutation [--packages routing,security,...]
[--max-mutants N] [--timeout-s S] [--out DIR]``.

A test suite only finds the bugs its assertions can see. This benchmark plants small bugs (a flipped comparison,
a changed constant, a dropped statement: mutmut's mutants) in the pure packages, one at a time, runs the unit
tests that cover each mutated function, and counts the mutants some test fails on ("killed"). A mutant that
changes nothing observable (an equivalent mutant) cannot be killed; those are listed with their reason in
`kvmesh.bench.mutation_equivalent` and left out of the rate:

    kill_rate = killed / (mutants − equivalent)

where `mutants` counts the mutants that ran (killed + survived + timed out; a timeout counts as killed: the
mutant hung a test) and a mutant no test covers counts as a survivor.

The tool is mutmut (pinned, the ``mutation`` extra; installed on first use when missing). It never touches the
checkout: the benchmark copies ``libs/kvmesh`` to ``DIR/src/kvmesh`` and ``tests``, ``docs``, ``scripts`` and
``protos`` (what tests read) to ``DIR``, writes mutmut's settings to ``DIR/pyproject.toml`` and runs mutmut there
(its mutants in ``DIR/mutants``; the tests import the mutated copy, which comes first on ``sys.path``). Each
mutant's tests run in a process forked from a server that has collected the tests but run none, so no cache the
unmutated code filled hides a mutant. ``--max-mutants N`` runs N mutants spread evenly over the selection (a
bounded sample); ``--timeout-s`` stops the run and counts what finished.

Slow (minutes per package on two cores), so it is not in CI. Prints one JSON line: ``mutants``, ``killed``,
``equivalent``, ``kill_rate``, per package the same, the survivors by name (``mutmut show NAME`` run in ``DIR``
prints a survivor's diff), and the mutants left unrun.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.bench.mutation_equivalent import EQUIVALENT

MUTMUT = "mutmut==3.8.1"
REPO = Path(__file__).resolve().parents[3]
# the tests, and what they read besides the code: docs kept in step with a table, a generator's --check, protos
ALSO_COPY = ("tests", "docs", "scripts", "protos")
KILLED_CODES = frozenset({1, 3, 36, -24, 24, 152, 255, -11, -9})  # failed, pytest internal error, timed out, crashed
SURVIVED_CODES = frozenset({0, 5, 33})  # tests passed, or no test covers the mutant


@dataclass(frozen=True, slots=True)
class Package:
    """What to mutate (globs under ``libs/kvmesh``) and the unit tests that cover it (paths under the repo)."""

    sources: tuple[str, ...]
    tests: tuple[str, ...]


PACKAGES: dict[str, Package] = {
    "routing": Package(("routing/*.py", "routing/*/*.py"), ("tests/unit/routing",)),
    "security": Package(("security/*.py",), ("tests/unit/security",)),
    "warming": Package(("ops/warming/*.py",), ("tests/unit/ops/warming",)),
    "planner": Package(("ops/planner/*.py",), ("tests/unit/ops/planner",)),
    "rollout": Package(("ops/rollout/*.py",), ("tests/unit/ops/rollout",)),
    "hashing": Package(
        ("index/hashing.py",), ("tests/unit/index/test_hashing.py", "tests/unit/index/test_hashing_edges.py")
    ),
    # the numpy index, its table and `IngestResult`, against their own fast unit tests: not the whole folder,
    # whose hypothesis and 3000-step property tests take seconds a mutant under mutmut, and whose tenant tests
    # (vLLM's decoder: 16 s), shared-memory process test, C-core and hashing tests run none of this code
    "index": Package(
        ("index/prefix_index.py", "index/_table.py", "index/types.py"),
        (
            "tests/unit/index/test_prefix_index_edges.py",
            "tests/unit/index/test_table_edges.py",
            "tests/unit/index/test_ingest_result_edges.py",
            "tests/unit/index/test_property.py::test_match_stops_at_first_missing_block_even_if_later_present",
            "tests/unit/index/test_property.py::test_worker_slots_are_reused_after_remove_worker",
            "tests/unit/index/test_property.py::test_large_random_against_reference",
            "tests/unit/index/test_property.py::test_long_queries_across_internal_chunks",
        ),
    ),
    "kvsync": Package(("kvplane/kvsync/codec.py", "kvplane/kvsync/tier.py"), ("tests/unit/kvplane/kvsync",)),
    "openai": Package(("openai/protocol.py",), ("tests/unit/openai",)),
}


def select(names: Sequence[str]) -> dict[str, Package]:
    """`--packages` entries: a package name, or ``package:glob`` narrowing it to some of its files
    (``routing:routing/circuit.py``)."""
    out: dict[str, Package] = {}
    for entry in names:
        name, _, narrow = entry.partition(":")
        if name not in PACKAGES:
            raise SystemExit(f"--packages: unknown package {name!r} (one of {', '.join(PACKAGES)})")
        pkg = PACKAGES[name]
        out[entry] = Package((narrow,), pkg.tests) if narrow else pkg
    return out


def ensure_mutmut() -> None:
    """Installs the pinned mutmut into this interpreter's environment when it is missing (said on stderr)."""
    if importlib.util.find_spec("mutmut") is not None:
        return
    print(
        f"mutation: installing {MUTMUT} (the mutation tool; `pip install -e '.[mutation]'` does it too)",
        file=sys.stderr,
    )
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", MUTMUT], check=True)


MARKER = ".kvmesh-mutation"


def check_workdir(work: Path) -> None:
    """`--out` is emptied of the previous copy on each run: it must be outside the checkout, and either new,
    empty or a folder an earlier run made (its marker file)."""
    resolved = work.resolve()
    if resolved == REPO or REPO in resolved.parents:
        raise SystemExit(f"--out: {work} is inside the checkout; give a folder outside it")
    if resolved.exists() and any(resolved.iterdir()) and not (resolved / MARKER).exists():
        raise SystemExit(f"--out: {work} is not empty and not an earlier mutation run's folder")
    resolved.mkdir(parents=True, exist_ok=True)
    (resolved / MARKER).touch()


def prepare(work: Path, packages: dict[str, Package]) -> None:
    """A fresh mutmut project in `work`: the sources and tests copied, mutmut's and pytest's settings."""
    for stale in ("mutants", "src", *ALSO_COPY):
        shutil.rmtree(work / stale, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "libs" / "kvmesh", work / "src" / "kvmesh", ignore=ignore)
    for folder in ALSO_COPY:
        shutil.copytree(REPO / folder, work / folder, ignore=ignore)
    only = sorted({f"src/kvmesh/{glob}" for pkg in packages.values() for glob in pkg.sources})
    tests = sorted({t for pkg in packages.values() for t in pkg.tests})
    settings = {
        "source_paths": ["src"],
        "also_copy": list(ALSO_COPY),
        "only_mutate": only,
        "pytest_add_cli_args_test_selection": tests,
        # quiet, no cache writes, none of the repository's addopts (its durations table); mutmut limits CPU time
        "pytest_add_cli_args": ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow"],
        # each mutant's tests run in a child of a server that collected the tests but ran none: forking from a
        # process that ran them would hand every mutant the caches the unmutated code filled (hashing's tables)
        "process_isolation": "forkserver",
        "forkserver_warmup": "collect",
        "use_git_change_detection": False,
        "use_setproctitle": False,
    }
    pytest_ini = {"asyncio_mode": "auto", "asyncio_default_fixture_loop_scope": "function", "markers": _markers()}
    lines = ["[tool.mutmut]", *(f"{k} = {_toml(v)}" for k, v in settings.items()), "", "[tool.pytest.ini_options]"]
    lines += [f"{k} = {_toml(v)}" for k, v in pytest_ini.items()]
    (work / "pyproject.toml").write_text("\n".join(lines) + "\n")


def _markers() -> list[str]:
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return list(ini.get("markers", []))


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def _mutmut(work: Path, args: Sequence[str], timeout_s: float | None) -> int:
    """Runs mutmut's CLI in `work` in its own process group (stopped whole at the timeout); its output goes to
    ``work/mutmut.log``. Returns its exit status, or -1 when it ran out of time."""
    code = "import sys\nfrom mutmut.__main__ import cli\nsys.exit(cli())"
    with open(work / "mutmut.log", "a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return -1


_GENERATE = """
from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
from mutmut.mutation.trampoline import set_mutant_under_test
set_mutant_under_test("mutant_generation")
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(1)
"""


def generate(work: Path) -> dict[str, int | None]:
    """Writes the mutants (without running any) and returns each one's recorded exit status (None: not run)."""
    subprocess.run([sys.executable, "-c", _GENERATE], cwd=work, check=True, stdout=subprocess.DEVNULL)
    return results(work)


def results(work: Path) -> dict[str, int | None]:
    """Every mutant mutmut knows in `work` and its exit status (None: not run)."""
    out: dict[str, int | None] = {}
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        out.update(json.loads(meta.read_text())["exit_code_by_key"])
    return out


def spread(names: Sequence[str], n: int) -> list[str]:
    """`n` of `names` (sorted) at even strides: a sample that covers every file and function alike."""
    ordered = sorted(names)
    if n >= len(ordered):
        return ordered
    return [ordered[i * len(ordered) // n] for i in range(n)]


def package_of(mutant: str, packages: dict[str, Package]) -> str:
    """The `--packages` entry a mutant's module belongs to (``kvmesh.routing.circuit.x_p95__mutmut_1``)."""
    module_path = "src/" + mutant.partition("__mutmut_")[0].rpartition(".")[0].replace(".", "/")
    for name, pkg in packages.items():
        for glob in pkg.sources:
            pattern = f"src/kvmesh/{glob}"
            if fnmatch.fnmatch(module_path + ".py", pattern) or fnmatch.fnmatch(module_path + "/__init__.py", pattern):
                return name
    return "?"


def tally(codes: dict[str, int | None], equivalent: Iterable[str]) -> dict[str, Any]:
    """The figures of one set of mutants: ran, killed, equivalent survivors, kill rate over the rest."""
    ran = {k: c for k, c in codes.items() if c in KILLED_CODES or c in SURVIVED_CODES}
    killed = {k for k, c in ran.items() if c in KILLED_CODES}
    survived = set(ran) - killed
    equiv = survived & set(equivalent)
    live = len(ran) - len(equiv)
    return {
        "mutants": len(ran),
        "killed": len(killed),
        "equivalent": len(equiv),
        "kill_rate": round(len(killed) / live, 4) if live else None,
        "survivors": sorted(survived - equiv),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench mutation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--packages", default=",".join(PACKAGES), help=f"comma-separated, of: {', '.join(PACKAGES)}")
    ap.add_argument("--max-mutants", type=int, default=0, help="run at most N mutants, spread evenly (0: all)")
    ap.add_argument("--timeout-s", type=float, default=0.0, help="stop after this long, count what finished")
    ap.add_argument("--out", type=Path, default=None, help="mutmut's working copy (default: a temporary folder)")
    args = ap.parse_args(argv)
    packages = select([p.strip() for p in args.packages.split(",") if p.strip()])
    ensure_mutmut()
    started = time.monotonic()
    work = args.out or Path(tempfile.mkdtemp(prefix="kvmesh-mutation-"))
    check_workdir(work)
    prepare(work, packages)
    generated = generate(work)
    chosen = spread(list(generated), args.max_mutants) if args.max_mutants > 0 else sorted(generated)
    run_args = ["run", "--max-children", "1"]
    if args.max_mutants > 0:
        run_args += chosen
    status = _mutmut(work, run_args, args.timeout_s or None)
    codes = {k: c for k, c in results(work).items() if k in set(chosen)}
    stale = sorted(k for k in EQUIVALENT if k not in generated and package_of(k, packages) != "?")
    killed_equivalent = sorted(k for k in EQUIVALENT if codes.get(k) in KILLED_CODES)
    totals = tally(codes, EQUIVALENT)
    by_package = {}
    for name in packages:
        mine = {k: c for k, c in codes.items() if package_of(k, packages) == name}
        figures = tally(mine, EQUIVALENT)
        by_package[name] = {k: figures[k] for k in ("mutants", "killed", "equivalent", "kill_rate")}
    out = {
        "bench": "mutation",
        **{k: totals[k] for k in ("mutants", "killed", "equivalent", "kill_rate")},
        "by_package": by_package,
        "survivors": totals["survivors"],
        "unrun": sum(1 for c in codes.values() if c is None) + len(set(chosen) - set(codes)),
        "generated": len(generated),
        "timed_out": status == -1,
        "mutmut_exit": status,
        # a listed equivalent that no longer exists (the code moved) or that a test now kills: fix the list
        "equivalent_stale": stale,
        "equivalent_killed": killed_equivalent,
        "seconds": round(time.monotonic() - started, 1),
        "out": str(work),
        "tool": MUTMUT,
    }
    print(json.dumps(out, sort_keys=False))
    return 0 if status in (0, -1) else 1
