"""The chaos campaign's invariants: each violation is told apart, and the reference is the engine's own."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.bench.chaos_check import RequestRecord, history, reference_tokens, tally, verdict


def record(expected: list[Any], received: list[Any], outcome: str = "ok", **kw: object) -> RequestRecord:
    """A finished request: per sequence, token ids (gRPC) or text (HTTP)."""
    r = RequestRecord("r1", "grpc", str(kw.pop("kind", "short")), started=10.0, deadline_s=30.0)
    r.expected, r.received, r.outcome, r.ended = expected, received, outcome, 12.0
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_the_reference_is_deterministic_and_seeded_sequences_resume_where_they_broke() -> None:
    prompt = list(range(100, 300))
    full = reference_tokens(prompt, 8, seed=7)[0]
    assert full == reference_tokens(prompt, 8, seed=7)[0] and len(full) == 8
    # a seeded stream resumed after 3 tokens (the prompt then ends with them) continues with the same tokens
    assert reference_tokens(prompt + full[:3], 5, seed=7)[0] == full[3:]
    two = reference_tokens(prompt, 6, n=2, temperature=0.8, seed=7)
    assert len(two) == 2 and two[0] != two[1]
    assert reference_tokens(prompt, 6, n=2)[0] == reference_tokens(prompt, 6, n=2)[1]  # greedy: copies


def test_each_violation_is_named() -> None:
    exp = [[1, 2, 3, 4]]
    assert verdict(record(exp, [[1, 2, 3, 4]])) == ""
    assert verdict(record(exp, [[1, 2, 3, 4, 4]])) == "duplicates"
    assert verdict(record(exp, [[1, 2, 2, 3, 4]])) == "wrong_tokens"  # a chunk twice mid-stream shifts the rest
    assert verdict(record(exp, [[1, 2, 4]])) == "wrong_tokens"  # a gap mid-stream
    assert verdict(record(exp, [[1, 2]])) == "lost"  # ended short
    assert verdict(record(exp, [[9, 9, 9, 9]])) == "wrong_tokens"
    assert verdict(record(exp, [], outcome="failed", error_code="UNAVAILABLE")) == "lost"
    assert verdict(record(exp, [[1]], outcome="hung")) == "hung"
    assert verdict(record(exp, [[1, 2, 3, 4]], ended=60.0)) == "hung"  # answered, but 50 s after its start
    assert verdict(record([[1], [2]], [[1]])) == "lost"  # a sequence missing
    assert verdict(record([" w5 w6"], [" w5 w7"])) == "wrong_tokens"  # HTTP: texts
    # pool-filling load: a failure is no loss, wrong tokens still are
    assert verdict(record(exp, [], outcome="failed", kind="fill")) == ""
    assert verdict(record(exp, [[9, 9, 9, 9]], kind="fill")) == "wrong_tokens"


def test_tally_counts_retried_successes_and_non_retryable_failures_and_keeps_fills_apart() -> None:
    records = [
        record([[1]], [[1]]),
        record([[1]], [[1]], attempts=2),
        record([[1]], [[1]], resent=True, migrations=1),
        record([[1]], [], outcome="failed", error_code="INVALID_ARGUMENT"),
        record([[1]], [[2]]),
        record([[1]], [], outcome="failed", kind="fill", error_code="UNAVAILABLE"),
    ]
    t, bad = tally(records)
    assert (t.requests, t.succeeded, t.retried_ok, t.lost, t.wrong_tokens, t.fills) == (5, 3, 2, 1, 1, 1)
    assert t.failed_non_retryable == 1 and t.migrated_ok == 1
    assert len(bad) == 2


def test_history_tells_the_whole_story_of_a_failed_invariant() -> None:
    r = record([[1, 2, 3]], [[1, 2, 7]])
    r.note(10.5, "attempt 1 via router-a (zone a)")
    r.note(11.0, "seq 0 +2 = 2")
    text = history(r)
    assert "wrong_tokens" in text and "attempt 1 via router-a" in text
    assert "expected [1, 2, 3]" in text and "received [1, 2, 7]" in text


def test_a_difference_is_a_tie_flip_only_where_a_confirmed_flip_explains_it() -> None:
    exp = [[1, 2, 3, 4]]
    ties = [{2: [3, 7]}]  # at position 2, 3 and 7 were within TIE_NATS of each other
    assert verdict(record(exp, [[1, 2, 7, 8]], ties=ties)) == "wrong_tokens"  # the tie alone excuses nothing
    assert verdict(record(exp, [[1, 2, 7, 8]], ties=ties, flips=[[2]])) == "tie_flip"  # recomputed from 7: 8
    assert verdict(record(exp, [[1, 2, 7]], ties=ties, flips=[[2]])) == "tie_flip"  # confirm_flips checked it
    assert verdict(record(exp, [[1, 2]], ties=ties)) == "lost"  # ended short: still a gap
    two = record([[1, 2], [1, 2]], [[1, 7], [1, 9]], ties=[{1: [2, 7]}, {1: [2, 7]}], flips=[[1], []])
    assert verdict(two) == "wrong_tokens"  # one sequence's flip does not excuse the other's difference
    t, bad = tally([record(exp, [[1, 2, 7, 8]], flips=[[2]]), record(exp, [[1, 2, 9, 4]], ties=ties)])
    assert (t.succeeded, t.tie_flips, t.wrong_tokens, len(bad)) == (1, 1, 1, 1)


def test_a_record_waiting_for_its_reference_has_no_verdict_yet() -> None:
    r = record([[1]], [[1]])
    r.expected = None
    with pytest.raises(ValueError, match="no reference yet"):
        verdict(r)
    assert "no reference yet" in history(r)
