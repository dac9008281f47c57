"""The chaos campaign's invariants over its request history: pure (no processes, sockets or clocks).

Every request the campaign sends becomes a `RequestRecord`: what it asked, what a fault-free run gives
(`expected`: the simulated engine's tokens from `reference_tokens`, or a fault-free HTTP call's text), what
arrived (per sequence, in order), each attempt and error with its time, and how it ended. `verdict(record)`
says which invariant it breaks, if any:

* ``wrong_tokens``: it succeeded with other tokens (or text) than the fault-free run's;
* ``duplicates``: more tokens arrived than the fault-free run has, the fault-free ones a prefix of them (a
  chunk delivered twice);
* ``lost``: it failed after its retries, ended short (a gap: fewer tokens, the fault-free ones' prefix), or
  failed with a code that is not retryable;
* ``hung``: it was still open past its deadline (plus `HANG_SLACK_S`), or failed later than that.

A record with none of these is fine; `retried_ok` counts the fine ones that needed more than one attempt (the
client's own retries and resumes, or the campaign's one re-send after a retryable failure), `migrated_ok` those
the router moved to another worker mid-stream. `history(record)`
is the text printed when an invariant fails. Pool-filling requests (``kind == "fill"``) are load, not
traffic: their failures are not losses, but their tokens are checked like any other.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmesh.core.generation import EngineRequest, SamplingParams
from kvmesh.engine.sim import SimConfig, SimEngineCore

HANG_SLACK_S = 5.0
# two log-probabilities this close are a near tie: a real engine's greedy pick between them may change with the
# batch it computes in (its float sums run in another order), so a first difference there is not kvmesh's
TIE_NATS = 0.02
# gRPC codes a client may retry (kvmesh.client.aio.RETRYABLE by name, plus its own deadline and Unavailable)
RETRYABLE_CODES = frozenset(
    {"UNAVAILABLE", "ABORTED", "CANCELLED", "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED"}
)


@dataclass
class RequestRecord:
    rid: str
    api: str  # "grpc" (kvmesh.client) or "http" (the router's OpenAI API)
    kind: str  # "session", "short", "long", "n2", "sampled", "http", "http_stream", "fill"
    started: float  # seconds since the campaign's start
    deadline_s: float
    n: int = 1
    prompt_tokens: int = 0
    # per sequence: token ids (grpc) or text (http); None until a real engine's reference run gives it
    expected: list[Any] | None = field(default_factory=list)
    received: list[Any] = field(default_factory=list)  # per sequence, as it arrived
    events: list[tuple[float, str]] = field(default_factory=list)  # (t, what): attempts, chunks, errors
    outcome: str = "open"  # "ok", "failed", "hung"
    error_code: str = ""
    ended: float | None = None
    attempts: int = 0  # router attempts (the client's on_attempt) and re-sends of the campaign
    resent: bool = False  # the campaign sent it again after a retryable failure
    migrations: int = 0  # the router moved it to another worker mid-stream this often (its own retries)
    prompt: list[int] = field(default_factory=list)  # what the reference run sends again (real engines)
    max_tokens: int = 0
    # per sequence, the reference's near ties: position -> the tokens whose log-probabilities are within
    # `TIE_NATS` of the most likely one's (two or more; a real engine's greedy choice among them may go any way)
    ties: list[dict[int, list[int]]] = field(default_factory=list)
    reference_tokens: list[list[int]] = field(default_factory=list)  # per sequence, the tokens behind a text
    # per sequence, the positions where it took another token of a near tie than the reference, each confirmed
    # by recomputing the greedy continuation from there (`chaos_reference.confirm_flips`); empty: none
    flips: list[list[int]] = field(default_factory=list)

    def note(self, t: float, what: str) -> None:
        self.events.append((round(t, 3), what))


def _compare(expected: Any, got: Any) -> str:
    """ "" when equal, else which invariant the difference breaks (token lists or texts alike)."""
    if got == expected:
        return ""
    if len(got) > len(expected) and got[: len(expected)] == expected:
        return "duplicates"
    if len(got) < len(expected) and expected[: len(got)] == got:
        return "lost"
    return "wrong_tokens"


def verdict(r: RequestRecord) -> str:
    """The invariant `r` breaks ("" when none): see the module docstring."""
    if r.outcome in ("open", "hung") or (r.ended is not None and r.ended - r.started > r.deadline_s + HANG_SLACK_S):
        return "hung"
    if r.outcome == "failed":
        return "" if r.kind == "fill" else "lost"
    if r.expected is None:
        raise ValueError(f"{r.rid}: no reference yet (a real engine's reference run fills it in)")
    if len(r.received) != len(r.expected):
        return "lost" if len(r.received) < len(r.expected) else "duplicates"
    worst = ""
    for i, (exp, got) in enumerate(zip(r.expected, r.received, strict=True)):
        v = _compare(exp, got)
        if v and i < len(r.flips) and r.flips[i]:  # a near tie went the other way, the rest recomputed from it
            v = "tie_flip"
        if v == "wrong_tokens" or (v and worst in ("", "tie_flip")):
            worst = v
    return "" if r.kind == "fill" and worst == "lost" else worst


def retryable(code: str) -> bool:
    return code in RETRYABLE_CODES


@dataclass
class Tally:
    requests: int = 0
    succeeded: int = 0
    retried_ok: int = 0
    migrated_ok: int = 0
    lost: int = 0
    wrong_tokens: int = 0
    duplicates: int = 0
    hung: int = 0
    failed_non_retryable: int = 0
    fills: int = 0
    tie_flips: int = 0  # succeeded, the reference's greedy path but for confirmed near-tie flips (real engines)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def tally(records: Iterable[RequestRecord]) -> tuple[Tally, list[RequestRecord]]:
    """The campaign's counts (fills apart) and the records that break an invariant."""
    t = Tally()
    bad: list[RequestRecord] = []
    for r in records:
        v = verdict(r)
        if r.kind == "fill":
            t.fills += 1
            if v and v != "tie_flip":
                setattr(t, v, getattr(t, v) + 1)
                bad.append(r)
            continue
        t.requests += 1
        if v == "tie_flip":
            t.tie_flips += 1
        if v and v != "tie_flip":
            setattr(t, v, getattr(t, v) + 1)
            bad.append(r)
        elif r.outcome == "ok":
            t.succeeded += 1
            t.retried_ok += int(r.attempts > 1 or r.resent)
            t.migrated_ok += int(r.migrations > 0)
        if r.outcome == "failed" and r.error_code and not retryable(r.error_code):
            t.failed_non_retryable += 1
    return t, bad


def history(r: RequestRecord) -> str:
    """The whole story of one request, for a failed invariant's report."""
    head = {
        k: v
        for k, v in asdict(r).items()
        if k not in ("events", "expected", "received", "prompt", "ties", "reference_tokens")
    }
    said = "no reference yet" if r.expected is None else verdict(r) or "fine"
    lines = [f"request {r.rid}: {said} {json.dumps(head)}"]
    lines += [f"  t={t:8.3f} {what}" for t, what in r.events]
    expected = r.expected if r.expected is not None else []
    for i, (exp, got) in enumerate(zip(expected, r.received, strict=False)):
        if exp != got:
            lines.append(f"  sequence {i}: expected {_short(exp)}")
            lines.append(f"  sequence {i}: received {_short(got)}")
    if len(expected) != len(r.received):
        lines.append(f"  sequences: expected {len(expected)}, received {len(r.received)}")
    return "\n".join(lines)


def _short(x: Any, keep: int = 40) -> str:
    s = json.dumps(x)
    return s if len(s) <= 2 * keep + 5 else f"{s[:keep]} ... {s[-keep:]} ({len(x)} items)"


def reference_tokens(
    prompt: Sequence[int], max_tokens: int, n: int = 1, temperature: float = 0.0, seed: int | None = None
) -> list[list[int]]:
    """What a fault-free simulated worker generates for this prompt (per sequence, `ignore_eos`): the engine's
    own state machine run here to completion, its clock virtual. The tokens depend on the prompt, the sampling
    seed and the position only, not on the worker or its cache, so one call stands for every worker of the
    suite (they run the same `SimConfig` vocabulary and no output salt)."""
    core = SimEngineCore(SimConfig(block_size=16, num_blocks=4096, max_model_len=1 << 16))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, n=n, ignore_eos=True)
    core.add_request(EngineRequest("reference", tuple(prompt), sampling=sampling), 0.0)
    out: list[list[int]] = [[] for _ in range(n)]
    now = 0.0
    for _ in range(100_000):
        if not core.has_work():
            break
        step = core.step(now)
        for o in step.outputs:
            out[o.index].extend(o.token_ids)
        now += step.duration_s
    return out
