"""`kvmesh.routing.attempts`: one test per decision branch, the next attempt's arithmetic, and property tests
driving simulated attempts through `Attempts` (bounded retries and migrations, no token lost or repeated)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.errors import InvalidArgument, Unavailable
from kvmesh.routing.attempts import (
    Action,
    Attempts,
    BreakerSample,
    BreakerTrip,
    Ended,
    Failed,
    Failure,
    Finished,
    LengthReached,
    Limits,
    NextAttempt,
    Outcome,
    Stalled,
    decide,
    next_attempt,
)

pytestmark = pytest.mark.unit

LIM = Limits(max_retries=2, max_migrations=2, max_tokens=10)
STOP = 1  # a finish reason


def test_finished_is_done_with_a_success_sample_of_the_worst_gap() -> None:
    d = decide("r", Finished(STOP, 37.5), n_attempt=4, retries=1, migrations=1, limits=LIM)
    assert d.action is Action.DONE
    assert d.breaker == BreakerSample(37.5)
    assert (d.retry, d.migration, d.error) == (0, 0, None)


def test_client_error_fails_with_invalid_argument_and_spares_the_breaker() -> None:
    d = decide("r", Failed(Failure.CLIENT_ERROR, "INVALID_ARGUMENT: bad"), 0, 0, 0, LIM)
    assert d.action is Action.FAIL and d.breaker is None
    assert isinstance(d.error, InvalidArgument)
    assert "worker rejected the request: INVALID_ARGUMENT: bad" in str(d.error)
    assert d.error.field == "request"  # the worker named no field
    assert (d.retry, d.migration) == (0, 0)
    named = decide("r", Failed(Failure.CLIENT_ERROR, "INVALID_ARGUMENT: x", "structured_outputs"), 0, 0, 0, LIM)
    assert isinstance(named.error, InvalidArgument) and named.error.field == "structured_outputs"


def test_client_cancel_fails_re_raising_the_callers_error() -> None:
    d = decide("r", Failed(Failure.CANCELLED, "CANCELLED: x"), 3, 0, 0, LIM)
    assert d.action is Action.FAIL and d.error is None and d.breaker is None
    assert (d.retry, d.migration) == (0, 0)


def test_worker_failure_before_a_token_is_a_retry_that_trips_the_breaker() -> None:
    d = decide("r", Failed(Failure.WORKER, "UNAVAILABLE: gone"), 0, 0, 0, LIM)
    assert d.action is Action.RETRY and d.retry == 1 and d.migration == 0
    assert d.breaker == BreakerTrip("UNAVAILABLE: gone")
    assert d.reason == "UNAVAILABLE: gone"


def test_worker_failure_after_tokens_is_a_migration() -> None:
    d = decide("r", Failed(Failure.WORKER, "UNAVAILABLE: gone"), 3, 0, 1, LIM)
    assert d.action is Action.MIGRATE and d.migration == 2 and d.retry == 0
    assert d.breaker == BreakerTrip("UNAVAILABLE: gone")


def test_resource_exhausted_retries_with_a_zero_sample_not_a_trip() -> None:
    d = decide("r", Failed(Failure.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED: full"), 0, 0, 0, LIM)
    assert d.action is Action.RETRY and d.breaker == BreakerSample(0.0)


def test_stream_end_without_finish_migrates_and_records_nothing() -> None:
    d = decide("r", Ended(), 2, 0, 0, LIM)
    assert d.action is Action.MIGRATE and d.migration == 1 and d.breaker is None
    assert d.reason == "stream ended without finish"


def test_a_stall_before_a_token_retries_and_after_tokens_migrates_tripping_the_breaker() -> None:
    d = decide("r", Stalled("STALLED: no first token"), 0, 0, 0, LIM)
    assert d.action is Action.RETRY and d.retry == 1
    assert d.breaker == BreakerTrip("STALLED: no first token")
    d = decide("r", Stalled("STALLED: no next token"), 3, 0, 1, LIM)
    assert d.action is Action.MIGRATE and d.migration == 2 and isinstance(d.breaker, BreakerTrip)
    d = decide("r", Stalled("STALLED"), 3, 0, 2, LIM)
    assert d.action is Action.FAIL and isinstance(d.error, Unavailable) and isinstance(d.breaker, BreakerTrip)


def test_retry_over_budget_fails_unavailable_and_still_counts() -> None:
    d = decide("r7", Ended(), 0, retries=2, migrations=0, limits=LIM)
    assert d.action is Action.FAIL and d.retry == 3
    assert isinstance(d.error, Unavailable)
    assert str(d.error) == "request r7 failed on 3 workers: stream ended without finish"


def test_migration_over_budget_fails_unavailable_and_keeps_the_breaker_trip() -> None:
    d = decide("r7", Failed(Failure.WORKER, "UNAVAILABLE: x"), 1, retries=0, migrations=2, limits=LIM)
    assert d.action is Action.FAIL and d.migration == 3
    assert d.breaker == BreakerTrip("UNAVAILABLE: x")
    assert isinstance(d.error, Unavailable) and str(d.error) == "request r7 migrated 3 times: UNAVAILABLE: x"


@pytest.mark.parametrize(
    ("max_tokens", "n", "min_tokens", "want"),
    [
        (10, 0, 4, NextAttempt(10, 4)),
        (10, 3, 4, NextAttempt(7, 1)),
        (10, 6, 4, NextAttempt(4, 0)),
        (10, 10, 4, LengthReached()),
        (10, 12, 0, LengthReached()),
    ],
)
def test_next_attempt_arithmetic(max_tokens: int, n: int, min_tokens: int, want: object) -> None:
    assert next_attempt(max_tokens, n, min_tokens) == want


def test_attempts_counts_resume_ids_as_tokens_so_far_but_not_as_this_attempts() -> None:
    att = Attempts("r", LIM, resume_ids=[5, 6, 7])
    assert att.next_attempt(min_tokens=5) == NextAttempt(7, 2)
    assert att.end(Ended()).action is Action.RETRY  # no token of its own: a retry, not a migration
    att.next_attempt(0)
    assert att.add([8]) == 1 and att.n_attempt == 1
    assert att.end(Ended()).action is Action.MIGRATE
    assert (att.retries, att.migrations, att.tokens) == (1, 1, [5, 6, 7, 8])
    att.next_attempt(0)
    assert att.n_attempt == 0  # a new attempt starts from zero


# ---- property tests: a tiny pure driver, as RouterCore._run drives Attempts --------------------------------


@dataclass(frozen=True)
class SimAttempt:
    """What one simulated worker does: streams `steps` messages of `per_step` tokens, then ends as `end`
    ("finish", "ended", "worker", "full", "stalled")."""

    steps: int
    per_step: int
    end: str


def truth(i: int) -> int:
    """The model's i-th output token: a worker resuming after n tokens continues at truth(n)."""
    return 1000 + i


def drive(limits: Limits, resume: list[int], script: list[SimAttempt]) -> tuple[list[int], str, Attempts]:
    """Runs the request over `script` (attempts beyond it finish at once); returns the tokens the client was
    sent, how it ended ("done", "length" or "fail") and the `Attempts`."""
    att = Attempts("r", limits, resume)
    emitted: list[int] = []
    for k in range(len(script) + 1):  # bounded: the last attempt always finishes
        plan = att.next_attempt(0)
        if isinstance(plan, LengthReached):
            return emitted, "length", att
        sim = script[k] if k < len(script) else SimAttempt(1, 1, "finish")
        start = len(att.tokens)  # the worker sees prompt + tokens so far and continues from there
        produced = [truth(start + i) for i in range(min(sim.steps * sim.per_step, plan.max_tokens))]
        for i in range(0, len(produced), max(sim.per_step, 1)):
            step = produced[i : i + sim.per_step]
            att.add(step)
            emitted.extend(step)
        outcome: Outcome
        if sim.end == "finish":
            outcome = Finished(STOP, 1.0)
        elif sim.end == "ended":
            outcome = Ended()
        elif sim.end == "stalled":
            outcome = Stalled("STALLED")
        else:
            failure = Failure.WORKER if sim.end == "worker" else Failure.RESOURCE_EXHAUSTED
            outcome = Failed(failure, "x")
        d = att.end(outcome)
        if d.action is Action.DONE:
            return emitted, "done", att
        if d.action is Action.FAIL:
            return emitted, "fail", att
    raise AssertionError("the driver did not end")


sim_attempts = st.builds(
    SimAttempt,
    steps=st.integers(0, 4),
    per_step=st.integers(1, 3),
    end=st.sampled_from(["finish", "ended", "worker", "full", "stalled"]),
)


@settings(max_examples=300, deadline=None)
@given(
    max_retries=st.integers(0, 3),
    max_migrations=st.integers(0, 3),
    max_tokens=st.integers(1, 20),
    n_resume=st.integers(0, 5),
    script=st.lists(sim_attempts, max_size=12),
)
def test_bounded_retries_and_migrations_and_no_duplicated_token(
    max_retries: int, max_migrations: int, max_tokens: int, n_resume: int, script: list[SimAttempt]
) -> None:
    resume = [truth(i) for i in range(n_resume)]
    emitted, how, att = drive(Limits(max_retries, max_migrations, max_tokens), resume, script)
    assert att.retries <= max_retries + 1 and att.migrations <= max_migrations + 1
    if how != "fail":  # the attempt that went over budget is counted, and fails the request
        assert att.retries <= max_retries and att.migrations <= max_migrations
    # the client gets every token after the ones it had, each once, in order, never past max_tokens
    assert emitted == [truth(i) for i in range(n_resume, n_resume + len(emitted))]
    assert att.tokens == resume + emitted
    assert len(att.tokens) <= max(max_tokens, n_resume)
    if how == "length":
        assert len(att.tokens) >= max_tokens


@settings(max_examples=100, deadline=None)
@given(max_migrations=st.integers(0, 3), n=st.integers(1, 10))
def test_a_worker_dying_after_every_token_fails_after_max_migrations_plus_one(max_migrations: int, n: int) -> None:
    script = [SimAttempt(1, 1, "worker")] * n
    emitted, how, att = drive(Limits(3, max_migrations, 100), [], script)
    if n <= max_migrations:
        assert how == "done" and att.migrations == n
    else:
        assert how == "fail" and att.migrations == max_migrations + 1
    assert emitted == [truth(i) for i in range(len(emitted))]
