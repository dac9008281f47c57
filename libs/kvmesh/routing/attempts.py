"""One request's attempts across workers: what happens after each attempt ends (pure: no clock, no I/O).

The router sends a request to a worker (an attempt) and streams its tokens to the client. When the attempt
ends, `decide` says what comes next and what the worker's circuit breaker records:

- `Finished` (the worker sent a finish reason): DONE; breaker: a success sample of the attempt's worst
  inter-token gap (ms).
- `Failed(CLIENT_ERROR)` (INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION: the request is wrong, not the
  worker): FAIL with InvalidArgument naming the field the worker named; breaker: nothing.
- `Failed(CANCELLED)` (the caller cancelled the call): FAIL, re-raising the caller's own error (`error` is
  None); breaker: nothing.
- `Failed(RESOURCE_EXHAUSTED)` (the worker is full): RETRY / MIGRATE; breaker: a success sample of 0 ms (it
  frees a half-open probe slot; a full worker is not a sick one).
- `Failed(WORKER)` (transport or worker failure, including a CANCELLED the caller did not ask for):
  RETRY / MIGRATE; breaker: a trip, the worker leaves rotation at once.
- `Ended` (the stream ended without a finish reason): RETRY / MIGRATE; breaker: nothing.
- `Stalled` (no token within the worker's stall bound, `kvmesh.routing.stall`: a frozen worker keeps its
  connection and sends nothing): RETRY / MIGRATE; breaker: a trip, the worker leaves rotation at once.

RETRY / MIGRATE: an attempt that produced no token is a retry (the request is re-sent elsewhere unchanged),
one that produced tokens is a migration (it resumes elsewhere with prompt + every token so far). The
retry or migration is counted either way; once there are more than `max_retries` retries or more than
`max_migrations` migrations the decision is FAIL with Unavailable instead.

`next_attempt`: the next attempt asks for the tokens still owed, `max_tokens - len(tokens so far)`, and
`min_tokens` lowered by the tokens so far (at least 0); when nothing is owed the request finishes with
LENGTH without another attempt. Tokens so far include `resume_ids`, the tokens the client already had.

`Attempts` holds one request's tokens so far and counts and applies these rules; the router's request path
(`kvmesh.services.router.core`) drives it, and so do the property tests.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

from kvmesh.core.errors import InvalidArgument, KvmeshError, Unavailable


class Action(enum.Enum):
    """What follows an attempt."""

    DONE = "done"  # finished: the final step goes to the client
    RETRY = "retry"  # failed before its first token: sent again elsewhere
    MIGRATE = "migrate"  # failed after tokens: resumed elsewhere with prompt + tokens so far
    FAIL = "fail"  # the request fails with `AttemptDecision.error`


class Failure(enum.Enum):
    """How an attempt failed, classified by the caller from the worker's status code."""

    CLIENT_ERROR = "client-error"
    CANCELLED = "cancelled"
    RESOURCE_EXHAUSTED = "resource-exhausted"
    WORKER = "worker"


@dataclass(frozen=True, slots=True)
class Finished:
    """The worker sent a finish reason; `max_gap_ms`: the attempt's worst inter-token gap."""

    finish_reason: int
    max_gap_ms: float


@dataclass(frozen=True, slots=True)
class Ended:
    """The worker's stream ended without a finish reason (the worker went away)."""

    detail: str = "stream ended without finish"


@dataclass(frozen=True, slots=True)
class Failed:
    """The attempt failed; `detail` ("CODE: details") goes into logs and errors; `field`: the request field a
    CLIENT_ERROR names (the worker's BadRequest detail; "request" when it names none)."""

    failure: Failure
    detail: str
    field: str = "request"


@dataclass(frozen=True, slots=True)
class Stalled:
    """No token arrived within the stall bound; the caller cancelled the attempt."""

    detail: str


Outcome: TypeAlias = Finished | Ended | Failed | Stalled


@dataclass(frozen=True, slots=True)
class BreakerSample:
    """The breaker records a success with this latency (ms)."""

    latency_ms: float


@dataclass(frozen=True, slots=True)
class BreakerTrip:
    """The breaker trips at once (and the worker leaves rotation); `reason` says why."""

    reason: str


BreakerRecord: TypeAlias = BreakerSample | BreakerTrip | None


@dataclass(frozen=True, slots=True)
class AttemptDecision:
    """`decide`'s answer. `retry` / `migration` > 0: the attempt counts as that retry / migration (a metric
    and a log line), also when it is over budget and `action` is FAIL. `error`: what FAIL raises (None:
    re-raise the caller's own error). `reason`: the failure's detail, '' when DONE."""

    action: Action
    breaker: BreakerRecord = None
    retry: int = 0
    migration: int = 0
    reason: str = ""
    error: KvmeshError | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """One request's failure budgets and its effective max_tokens."""

    max_retries: int
    max_migrations: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class NextAttempt:
    """The next attempt's sampling changes: the tokens still owed and the adjusted min_tokens."""

    max_tokens: int
    min_tokens: int


@dataclass(frozen=True, slots=True)
class LengthReached:
    """Nothing is owed: finish with LENGTH without another attempt."""


def next_attempt(max_tokens: int, n_so_far: int, min_tokens: int) -> NextAttempt | LengthReached:
    """The next attempt's `max_tokens`/`min_tokens` after `n_so_far` tokens (see the module docstring)."""
    remaining = max_tokens - n_so_far
    if remaining <= 0:
        return LengthReached()
    return NextAttempt(remaining, max(min_tokens - n_so_far, 0))


def decide(
    request_id: str,
    outcome: Outcome,
    n_attempt: int,
    retries: int,
    migrations: int,
    limits: Limits,
) -> AttemptDecision:
    """What follows an attempt that ended with `outcome` after producing `n_attempt` tokens, given the
    retries and migrations before it (rules in the module docstring)."""
    if isinstance(outcome, Finished):
        return AttemptDecision(Action.DONE, BreakerSample(outcome.max_gap_ms))
    breaker: BreakerRecord = None
    if isinstance(outcome, Failed):
        if outcome.failure is Failure.CLIENT_ERROR:
            rejected = InvalidArgument(outcome.field, f"worker rejected the request: {outcome.detail}")
            return AttemptDecision(Action.FAIL, reason=outcome.detail, error=rejected)
        if outcome.failure is Failure.CANCELLED:
            return AttemptDecision(Action.FAIL, reason=outcome.detail)
        full = outcome.failure is Failure.RESOURCE_EXHAUSTED
        breaker = BreakerSample(0.0) if full else BreakerTrip(outcome.detail)
    elif isinstance(outcome, Stalled):
        breaker = BreakerTrip(outcome.detail)
    reason = outcome.detail
    if n_attempt == 0:
        retry = retries + 1
        if retry > limits.max_retries:
            error = Unavailable(f"request {request_id} failed on {retry} workers: {reason}")
            return AttemptDecision(Action.FAIL, breaker, retry=retry, reason=reason, error=error)
        return AttemptDecision(Action.RETRY, breaker, retry=retry, reason=reason)
    migration = migrations + 1
    if migration > limits.max_migrations:
        error = Unavailable(f"request {request_id} migrated {migration} times: {reason}")
        return AttemptDecision(Action.FAIL, breaker, migration=migration, reason=reason, error=error)
    return AttemptDecision(Action.MIGRATE, breaker, migration=migration, reason=reason)


class Attempts:
    """One request's attempts: the tokens so far (starting with `resume_ids`) and the retries and migrations
    used. The driver calls `next_attempt()`, `add(tokens)` for each streamed step, then `end(outcome)`."""

    __slots__ = ("_n_attempt", "_n_resumed", "limits", "migrations", "request_id", "retries", "tokens")

    def __init__(self, request_id: str, limits: Limits, resume_ids: Iterable[int] = ()) -> None:
        self.request_id = request_id
        self.limits = limits
        self.tokens: list[int] = list(resume_ids)
        self._n_resumed = len(self.tokens)
        self.retries = 0
        self.migrations = 0
        self._n_attempt = 0

    def next_attempt(self, min_tokens: int) -> NextAttempt | LengthReached:
        """Starts an attempt: its sampling changes, or LengthReached (see `next_attempt`)."""
        self._n_attempt = 0
        return next_attempt(self.limits.max_tokens, len(self.tokens), min_tokens)

    def add(self, token_ids: Iterable[int]) -> int:
        """Appends one streamed step's tokens; returns how many."""
        before = len(self.tokens)
        self.tokens.extend(token_ids)
        n = len(self.tokens) - before
        self._n_attempt += n
        return n

    @property
    def n_generated(self) -> int:
        """Tokens generated for this request (the resumed ones the client sent are not: usage counts these)."""
        return len(self.tokens) - self._n_resumed

    @property
    def n_attempt(self) -> int:
        """Tokens produced by the current attempt."""
        return self._n_attempt

    def end(self, outcome: Outcome) -> AttemptDecision:
        """Decides what follows the current attempt and counts its retry or migration."""
        d = decide(self.request_id, outcome, self._n_attempt, self.retries, self.migrations, self.limits)
        self.retries = max(self.retries, d.retry)
        self.migrations = max(self.migrations, d.migration)
        return d
