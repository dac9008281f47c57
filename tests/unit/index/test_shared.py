"""The shared prefix index (`kvmesh.index.shared`): a reader in another process answers as the writer does, through
every growth of the table and spill pool, and never acts on half a change."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvmesh.index import NATIVE
from kvmesh.index.native_index import NativePrefixIndex
from kvmesh.index.shared import SharedIndexView, SharedPrefixIndex, remove_files

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not NATIVE, reason="the shared index is the compiled one")]


@pytest.fixture
def path() -> Iterator[str]:
    p = f"/dev/shm/kvmesh-test-{uuid.uuid4().hex[:12]}"
    yield p
    remove_files(p)


def u64(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def test_a_view_answers_as_the_writer_through_every_growth(path: str) -> None:
    rng = random.Random(7)
    writer, private = SharedPrefixIndex(path, capacity=16), NativePrefixIndex(capacity=16)
    view = SharedIndexView(path)
    chains = [[rng.getrandbits(64) for _ in range(40)] for _ in range(60)]
    # 300 workers: the spill pool's masks grow from 1 to 5 words; 60 × 40 blocks regrow the table
    for step in range(3000):
        worker, chain = f"w{rng.randrange(300)}", rng.choice(chains)
        cut = rng.randrange(1, 41)
        op = rng.random()
        for ix in (writer, private):
            if op < 0.7:
                ix.store(worker, None, u64(chain[:cut]))
            elif op < 0.95:
                ix.remove(worker, u64(chain[cut - 1 :]))
            else:
                ix.clear(worker)
        if step % 50 == 0:
            q = rng.choice(chains)
            assert view.find_matches(q) == writer.find_matches(q) == private.find_matches(q)
            assert view.first_held(worker, q) == writer.first_held(worker, q) == private.first_held(worker, q)
    assert writer.stats()["mask_words"] == 5 and writer.stats()["table_capacity"] > 1024
    assert view.stats()["pairs"] == private.num_pairs() > 0
    for q in chains:
        assert view.find_matches(q) == private.find_matches(q)


def test_a_reused_worker_slot_is_read_under_its_new_name(path: str) -> None:
    writer = SharedPrefixIndex(path)
    view = SharedIndexView(path)
    writer.store("a", None, u64([1, 2, 3]))
    assert view.find_matches([1, 2, 3]) == {"a": 3}
    writer.remove_worker("a")
    writer.store("b", None, u64([1, 2]))  # takes a's slot
    assert view.find_matches([1, 2, 3]) == {"b": 2}
    assert view.first_held("a", [1, 2]) == 2 and view.first_held("b", [9, 2]) == 1


def test_a_new_writer_takes_the_header_over_and_readers_follow_it(path: str) -> None:
    first = SharedPrefixIndex(path)
    first.store("a", None, u64([1, 2]))
    first.set_word(1, 1)
    first.set_word(2, 41)
    view = SharedIndexView(path)
    assert view.find_matches([1, 2]) == {"a": 2}
    second = SharedPrefixIndex(path)  # a restarted writer, or a replica reset
    assert view.find_matches([1, 2]) == {}  # the same view now reads the new, empty index
    assert view.word(1) == 0 and view.word(2) == 0  # the owner's words start over
    second.store("c", None, u64([1]))
    assert view.find_matches([1, 2]) == {"c": 1} and not view.replaced()
    del first  # the old writer's arrays go; the header and the new writer's stay
    assert view.find_matches([1, 2]) == {"c": 1}
    assert sorted(os.listdir("/dev/shm")).count(os.path.basename(path)) == 1


def test_remove_files_leaves_nothing_and_a_view_then_reopens(path: str) -> None:
    writer = SharedPrefixIndex(path)
    writer.store("a", None, u64(list(range(1, 5000))))
    view = SharedIndexView(path)
    remove_files(path)
    base = os.path.basename(path)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(base)]
    assert view.replaced()
    with pytest.raises(FileNotFoundError):
        SharedIndexView(path)


def test_bad_paths_are_clear_errors(tmp_path: object) -> None:
    with pytest.raises(FileNotFoundError, match="/no/such/dir/index"):
        SharedPrefixIndex("/no/such/dir/index")
    not_an_index = f"/dev/shm/kvmesh-test-{uuid.uuid4().hex[:12]}"
    with open(not_an_index, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        with pytest.raises(ValueError, match="is not a kvmesh shared index"):
            SharedIndexView(not_an_index)
    finally:
        os.unlink(not_an_index)


READER = """
import json, sys
from kvmesh.index.shared import SharedIndexView
view, query, seen = SharedIndexView(sys.argv[1]), list(range(1, 101)), {}
print("ready", flush=True)
for _ in range(int(sys.argv[2])):
    found = view.find_matches(query)
    key = "none" if found is None else str(found.get("x", 0))
    seen[key] = seen.get(key, 0) + 1
print(json.dumps({"seen": seen, **view.stats()}), flush=True)
"""


def test_a_reader_process_never_sees_half_a_change(path: str) -> None:
    """The writer flips x between holding blocks 1..100 and 1..50 (one change each, whose every intermediate
    state x holds a prefix between the two) and grows the table and spill pool meanwhile; a reader process
    querying 1..100 on the other core must only ever see 50 or 100."""
    query = list(range(1, 101))
    writer = SharedPrefixIndex(path)
    writer.store("x", None, u64(query))
    for k in range(6):  # blocks 1..50 spill: held by x and 6 others
        writer.store(f"o{k}", None, u64(query[:50]))
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, path, "20000"], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    deadline, filler, flips = time.monotonic() + 120, 10**9, 0
    while proc.poll() is None and time.monotonic() < deadline and flips < 2_000_000:
        writer.remove("x", u64(query[:49:-1]))  # last block first: every state in between is a prefix
        writer.store("x", None, u64(query[50:]))
        flips += 1
        if flips % 200 == 0 and filler < 10**9 + 400_000:  # growth under the reader
            writer.store(f"f{flips % 70}", None, np.arange(filler, filler + 4000, dtype=np.uint64))
            filler += 4000
    out = json.loads(proc.communicate(timeout=60)[0].splitlines()[-1])
    assert proc.returncode == 0
    seen = out["seen"]
    assert set(seen) <= {"50", "100", "none"}, seen
    assert seen.get("50", 0) + seen.get("100", 0) > 0, seen
    assert flips > 0
