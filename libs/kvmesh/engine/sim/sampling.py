"""The simulated engine's token choice under the request's token rules, and its synthetic log-probabilities.

The simulated engine has no model and no logits: its token at a position is a 64-bit mix of (seed, position)
(`SimEngineCore._mix`). What a request can still ask of that choice, and how it is honoured here
(docs/engine-model.md says it for every field):

- `allowed_token_ids`: the choice is made among those ids only.
- `logit_bias`: a bias of at least +`FORCE_BIAS` forces its token (the largest bias wins, the smaller id on a
  tie), one of at most -`FORCE_BIAS` bans it: on a real model such biases decide the token as well. A smaller
  bias only shifts probabilities the simulated engine does not have: it does not change the choice.
- `bad_words`: each word, tokenised as vLLM does (as given, and with a leading space), can never be
  completed: when the tokens generated so far end with all but a word's last token, that token is banned.

A banned candidate is replaced by the next one of a deterministic sequence derived from the same mix, so the
output stays a pure function of the request.

Log-probabilities are synthetic, and documented as such: the chosen token is always the most likely one
(rank 1) with probability in [0.35, 0.95] from a fixed formula of (token, position); the alternatives are
deterministic other ids at ranks 2, 3, ... sharing the rest of the probability mass geometrically (each half
of the one before), so the probabilities are sorted by rank and sum to at most 1. A prompt position is
treated alike (its token rank 1), so prompt log-probabilities depend on the prompt only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import PositionLogprobs, SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
FORCE_BIAS = 50.0  # |bias| from which the simulated engine forces / bans a token (OpenAI's ±100 does)
MAX_REDRAWS = 64  # candidates tried past a banned one before giving up the bans for this position
P_MIN, P_MAX = 0.35, 0.95  # the chosen token's synthetic probability range


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit function of `x`."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class TokenRules:
    """A request's constraints on the simulated engine's token choice (see the module docstring)."""

    allowed: tuple[int, ...] = ()  # empty: every id of the vocabulary
    forced: int | None = None
    banned: frozenset[int] = frozenset()
    bad_words: tuple[tuple[int, ...], ...] = ()

    def choose(self, x: int, generated: Sequence[int], vocab_size: int) -> int:
        """The token for mix `x`, given the tokens generated so far (for `bad_words`)."""
        if self.forced is not None:
            return self.forced
        banned = self.banned | self._bad_word_ends(generated) if self.bad_words else self.banned
        candidates = self.allowed or None
        first = -1
        for i in range(MAX_REDRAWS):
            y = _mix(x + i * _GOLDEN) if i else x
            tok = candidates[y % len(candidates)] if candidates else y % vocab_size
            if first < 0:
                first = tok
            if tok not in banned:
                return tok
        return first  # every candidate tried is banned (e.g. all allowed ids): the bans give way

    def _bad_word_ends(self, generated: Sequence[int]) -> frozenset[int]:
        """The last token of every bad word whose other tokens end the output so far."""
        out: set[int] = set()
        for word in self.bad_words:
            k = len(word) - 1
            if k == 0 or (len(generated) >= k and tuple(generated[-k:]) == word[:-1]):
                out.add(word[-1])
        return frozenset(out)


def token_rules(p: SamplingParams, vocab_size: int, encode: Callable[[str], list[int]] | None) -> TokenRules | None:
    """The rules of `p` (None when it sets none: the plain, fast choice); raises InvalidArgument for an id
    outside the vocabulary, or bad words without a tokenizer to spell them."""
    if not (p.allowed_token_ids or p.logit_bias or p.bad_words):
        return None
    for name, ids in (("allowed_token_ids", p.allowed_token_ids), ("logit_bias", [t for t, _ in p.logit_bias])):
        if any(t >= vocab_size for t in ids):
            raise InvalidArgument(name, f"token ids must be in [0, {vocab_size})")
    forcing = [(b, -t) for t, b in p.logit_bias if b >= FORCE_BIAS]
    forced = -max(forcing)[1] if forcing else None
    banned = frozenset(t for t, b in p.logit_bias if b <= -FORCE_BIAS)
    words: list[tuple[int, ...]] = []
    if p.bad_words:
        if encode is None:
            raise InvalidArgument("bad_words", "this simulated engine has no tokenizer to spell them")
        for w in p.bad_words:
            for spelt in (w.lstrip(), " " + w.lstrip()):  # vLLM bans both spellings
                ids = tuple(encode(spelt))
                if ids and ids not in words:
                    words.append(ids)
    return TokenRules(tuple(p.allowed_token_ids), forced, banned, tuple(words))


def synthetic_logprobs(token: int, position: int, k: int, vocab_size: int) -> PositionLogprobs:
    """Synthetic log-probabilities at `position` where the token is `token` (rank 1) and `k` alternatives
    are asked for: `top` holds the k most likely, `token` first (see the module docstring)."""
    h = _mix(token * _GOLDEN + position + 1)
    p1 = P_MIN + (P_MAX - P_MIN) * ((h >> 11) / float(1 << 53))
    chosen = TokenLogprob(token, math.log(p1), 1)
    top = [chosen]
    rest = 1.0 - p1
    step = 1 + (h % max(1, vocab_size - 1))  # a non-zero stride from `token`
    used = {token}
    for rank in range(2, min(k, vocab_size) + 1):
        alt = (token + (rank - 1) * step) % vocab_size
        while alt in used:  # a stride that wraps onto an id already listed
            alt = (alt + 1) % vocab_size
        used.add(alt)
        top.append(TokenLogprob(alt, math.log(rest * 0.5 ** (rank - 1)), rank))
    return PositionLogprobs(chosen, tuple(top[:k]))


def prompt_logprobs(prompt: Sequence[int], k: int, vocab_size: int) -> tuple[PositionLogprobs | None, ...]:
    """Synthetic log-probabilities of every prompt position (the first has none, as in vLLM)."""
    return (None, *(synthetic_logprobs(t, i, k, vocab_size) for i, t in enumerate(prompt) if i))
