"""The reference run's near ties: where a real engine's greedy pick could go either way."""

from __future__ import annotations

from kvmesh.bench.chaos_check import TIE_NATS
from kvmesh.bench.chaos_reference import near_ties
from kvmesh.v1 import common_pb2


def step(*top: tuple[int, float], pick: int = 0) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(token_id=top[pick][0], logprob=top[pick][1], rank=pick + 1),
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
    assert near_ties(steps) == {0: [5, 6], 2: [9, 4]}
    assert near_ties(steps, offset=10) == {10: [5, 6], 12: [9, 4]}


def test_a_tie_is_every_token_within_the_bound_of_the_best_whatever_the_engine_ranks_first() -> None:
    """vLLM ranks a sampled token by how many are at least as likely: of two equal ones the greedy pick can be
    listed second. The tie is the set, so the pick is in it wherever it is listed."""
    equal = step((571, -1.0), (837, -1.0), (4, -1.0 - TIE_NATS / 2), (9, -2.0), pick=1)
    listed_below = step((3, -0.7), (8, -0.7 - TIE_NATS / 2), (5, -0.9))
    assert near_ties([equal, listed_below]) == {0: [571, 837, 4], 1: [3, 8]}
    assert 837 in near_ties([equal])[0] and 9 not in near_ties([equal])[0]
