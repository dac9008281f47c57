"""The mutation benchmark's bookkeeping (no mutmut run): the even sample, the tally and its kill rate over the
non-equivalent mutants, which package a mutant belongs to, and the equivalent list's entries."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.bench.mutation import PACKAGES, REPO, check_workdir, package_of, select, spread, tally
from kvmesh.bench.mutation_equivalent import EQUIVALENT

pytestmark = pytest.mark.unit


def test_spread_takes_n_at_even_strides_and_all_when_fewer() -> None:
    names = [f"m{i:02d}" for i in range(10)]
    assert spread(names[::-1], 5) == ["m00", "m02", "m04", "m06", "m08"]
    assert spread(names, 20) == names and spread(names, 1) == ["m00"]


def test_tally_counts_timeouts_as_killed_no_tests_as_survivors_and_leaves_out_equivalents() -> None:
    codes: dict[str, int | None] = {"a": 1, "b": 0, "c": 33, "d": 36, "e": None, "f": 0}
    t = tally(codes, equivalent=["f", "a"])  # a listed equivalent that was killed stays killed
    assert (t["mutants"], t["killed"], t["equivalent"]) == (5, 2, 1)
    assert t["kill_rate"] == 0.5 and t["survivors"] == ["b", "c"]
    assert tally({"x": None}, [])["kill_rate"] is None


def test_package_of_and_select() -> None:
    packages = select(["routing", "hashing"])
    assert package_of("kvmesh.routing.circuit.x_p95__mutmut_1", packages) == "routing"
    assert package_of("kvmesh.routing.filters.healthy.x_f__mutmut_1", packages) == "routing"
    assert package_of("kvmesh.index.hashing.x_make_salt__mutmut_1", packages) == "hashing"
    assert package_of("kvmesh.ops.rollout.canary.x_analyse__mutmut_1", packages) == "?"
    narrow = select(["routing:routing/circuit.py"])
    assert narrow["routing:routing/circuit.py"].sources == ("routing/circuit.py",)
    with pytest.raises(SystemExit, match="unknown package 'nope'"):
        select(["nope"])


def test_every_equivalent_mutant_is_in_a_package_and_says_why() -> None:
    for name, reason in EQUIVALENT.items():
        assert "__mutmut_" in name and package_of(name, PACKAGES) != "?", name
        assert len(reason) > 20, name


def test_the_working_folder_is_never_the_checkout_or_someone_else_s(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="inside the checkout"):
        check_workdir(REPO / "build-mutation")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty"):
        check_workdir(tmp_path)
    check_workdir(tmp_path / "new")
    check_workdir(tmp_path / "new")  # an earlier run's folder: reused
    assert (tmp_path / "new" / ".kvmesh-mutation").exists()
