"""The reference run's near ties: where a real engine's greedy pick could go either way."""

from __future__ import annotations

from kvmesh.bench.chaos_check import TIE_NATS
from kvmesh.bench.chaos_reference import near_ties
from kvmesh.v1 import common_pb2


def step(*top: tuple[int, float]) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(token_id=top[0][0], logprob=top[0][1], rank=1),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=lp, rank=i + 1) for i, (t, lp) in enumerate(top)],
    )


def test_near_ties_are_the_positions_whose_two_best_are_within_the_bound_counted_from_the_offset() -> None:
    steps = [
        step((5, -0.50), (6, -0.50 - TIE_NATS / 2)),  # a near tie: 6 could have won
        step((7, -0.10), (8, -3.00)),  # a clear choice
        step((9, -1.00), (4, -1.00 - TIE_NATS)),  # exactly at the bound: still a tie
        step((3, -1.00), (2, -1.00 - 2 * TIE_NATS)),
        step((1, -0.2)),  # one alternative only: nothing to flip to
    ]
    assert near_ties(steps) == {0: 6, 2: 4}
    assert near_ties(steps, offset=10) == {10: 6, 12: 4}
