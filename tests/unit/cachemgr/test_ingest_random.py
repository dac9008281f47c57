"""Random interleavings: lossy, duplicating, reordering delivery + a transport honouring resync requests.

Whatever the network does, once the transport has answered every resync request (replay from the
worker's buffer when it still has it, a full dump otherwise), the index equals the engines' truth.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cachemgr.ingest import Ingestor, Phase
from kvmesh.core.kvevents import KvEventBatch
from tests.unit.cachemgr.test_ingest_state import BS, WALL_CLOCK, SetIndex, ToyEngine, make_hasher


def run(seed: int, drop: float, dup: float, replay_window: int) -> None:
    rng = random.Random(seed)
    hasher = make_hasher()
    idx = SetIndex()
    ing = Ingestor(idx, hasher, BS, max_pending=64)  # type: ignore[arg-type]
    engines = {w: ToyEngine(w, hasher, seed=i) for i, w in enumerate(["a", "b", "c"])}
    log: dict[str, list[KvEventBatch]] = {w: [] for w in engines}
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    in_flight: list[KvEventBatch] = []

    def resync(req: object) -> None:
        w = req.worker_id  # type: ignore[attr-defined]
        eng = engines[w]
        if not req.full_dump and req.from_sequence >= eng.seq - replay_window:  # type: ignore[attr-defined]
            for b in log[w][req.from_sequence :]:  # type: ignore[attr-defined]
                handle(ing.apply(b))
            if ing.workers[w].phase is Phase.REPLAYING:
                handle(ing.replay_failed(w))
            return
        handle(ing.begin_dump(w, eng.instance, float(next(WALL_CLOCK))))
        handle(ing.apply_dump(w, eng.dump()))
        handle(ing.end_dump(w, eng.seq))

    def handle(res: object) -> None:
        if res.resync is not None:  # type: ignore[attr-defined]
            resync(res.resync)  # type: ignore[attr-defined]

    for _step in range(300):
        w = rng.choice(sorted(engines))
        eng = engines[w]
        op = rng.random()
        if op < 0.6:
            b = eng.prompt(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 13))])
        elif op < 0.9:
            b = eng.evict(rng.randrange(1, 5), rng)
        elif op < 0.95:
            b = eng.clear()
        else:  # restart: a fresh engine under a new instance id
            engines[w] = eng = ToyEngine(w, hasher, seed=rng.randrange(10**6), instance=f"i{_step}")
            log[w] = []
            b = eng.prompt(rng.choice(prefixes))
        log[w].append(b)
        if rng.random() >= drop:
            in_flight.append(b)
        if rng.random() < dup and log[w]:
            in_flight.append(rng.choice(log[w]))
        rng.shuffle(in_flight[-3:])  # local reordering
        while len(in_flight) > 2:
            handle(ing.apply(in_flight.pop(0)))
    for b in in_flight:
        handle(ing.apply(b))
    # the live stream's tail may have been lost: the last batch of each worker closes the gap
    for w in engines:
        if log[w]:
            handle(ing.apply(log[w][-1]))
    for req in ing.pending_resyncs():
        resync(req)
    for w, eng in engines.items():
        assert idx.held.get(w, set()) == eng.truth(), w
        assert ing.workers[w].phase is Phase.SYNCED


@pytest.mark.unit
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    drop=st.sampled_from([0.0, 0.05, 0.3]),
    dup=st.sampled_from([0.0, 0.1]),
    window=st.sampled_from([0, 5, 1000]),
)
def test_random_interleavings_converge_to_truth(seed: int, drop: float, dup: float, window: int) -> None:
    run(seed, drop, dup, window)
