"""The simulated engine and the sampling fields beyond OpenAI's basics: `n` sequences sharing the prompt's
blocks, synthetic log-probabilities, the token rules (allowed ids, logit bias, bad words), the refusal of
structured outputs; a request using none of them is served as before."""

from __future__ import annotations

import itertools
import math

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import EngineOutput, EngineRequest, SamplingParams, StructuredOutput
from kvmesh.engine.clock import VirtualClock
from kvmesh.engine.sim.core import SimConfig, SimEngineCore
from kvmesh.engine.sim.driver import SimEngine
from kvmesh.engine.sim.sampling import synthetic_logprobs
from kvmesh.engine.tokenizer import ByteTokenizer
from tests.unit.engine.sim.test_core import run

pytestmark = pytest.mark.unit
BS = 16
PROMPT = tuple(range(1, 1 + 5 * BS + 3))  # five full blocks and a tail of 3


def core(**kw: object) -> SimEngineCore:
    return SimEngineCore(SimConfig(block_size=BS, num_blocks=256), **kw)  # type: ignore[arg-type]


def outputs(c: SimEngineCore, req: EngineRequest) -> list[EngineOutput]:
    c.add_request(req, 0.0)
    _, steps = run(c)
    return [o for s in steps for o in s.outputs]


def sampling(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 4), **kw)  # type: ignore[arg-type]


def tokens_by_index(outs: list[EngineOutput]) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for o in outs:
        got.setdefault(o.index, []).extend(o.token_ids)
    return got


def test_n_sequences_are_indexed_share_the_prompt_blocks_and_usage_counts_them_all() -> None:
    c = core()
    c.add_request(EngineRequest("r", PROMPT, sampling=sampling(n=3, temperature=1.0)), 0.0)
    _, steps = run(c)
    outs = [o for s in steps for o in s.outputs]
    toks = tokens_by_index(outs)
    assert sorted(toks) == [0, 1, 2] and all(len(t) == 4 for t in toks.values())
    assert len({tuple(t) for t in toks.values()}) == 3  # sampled: each sequence its own tokens
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    # sequence 0 computes the prompt; the others reuse its five full blocks and compute the tail only
    assert sum(s.prefill_tokens for s in steps) == len(PROMPT) + 2 * 3
    last = outs[-1]
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPT), 3 * 4)
    assert not c.has_work() and c.request_ids() == []
    assert c.pool.num_used == 0


def test_greedy_sequences_are_copies_and_sequence_0_is_the_single_request() -> None:
    many = tokens_by_index(outputs(core(), EngineRequest("r", PROMPT, sampling=sampling(n=2, temperature=0.0))))
    one = tokens_by_index(outputs(core(), EngineRequest("r", PROMPT, sampling=sampling(temperature=0.0))))
    assert many[0] == many[1] == one[0]


def test_abort_ends_every_open_sequence() -> None:
    c = core()
    c.add_request(EngineRequest("r", PROMPT, sampling=sampling(n=2, max_tokens=50)), 0.0)
    c.step(0.0)
    outs = c.abort_request("r", 1.0)
    assert sorted(o.index for o in outs) == [0, 1] and all(o.finish_reason == "abort" for o in outs)
    assert not c.has_work() and c.pool.num_used == 0
    assert c.abort_request("r", 1.0) == []


def test_a_plain_request_has_sequence_0_and_no_logprobs() -> None:
    outs = outputs(core(), EngineRequest("r", PROMPT, sampling=sampling()))
    assert all(o.index == 0 and o.logprobs == () and o.prompt_logprobs == () for o in outs)


def test_logprobs_are_synthetic_deterministic_and_well_formed() -> None:
    req = EngineRequest("r", PROMPT, sampling=sampling(logprobs=3, prompt_logprobs=2, temperature=0.7, seed=5))
    outs = outputs(core(), req)
    assert outs == outputs(core(), req)
    for o in outs:
        (pos,) = o.logprobs
        assert pos.token.token_id == o.token_ids[0] and pos.token.rank == 1
        assert [x.rank for x in pos.top] == [1, 2, 3] and pos.top[0] == pos.token
        assert len({x.token_id for x in pos.top}) == 3
        lps = [x.logprob for x in pos.top]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1.0
    prompt = outs[0].prompt_logprobs
    assert len(prompt) == len(PROMPT) and prompt[0] is None
    assert all(
        p is not None and p.token.token_id == t and len(p.top) == 2 for p, t in zip(prompt[1:], PROMPT[1:], strict=True)
    )
    assert all(o.prompt_logprobs == () for o in outs[1:])


def test_logprobs_zero_gives_the_token_alone() -> None:
    p = synthetic_logprobs(7, 3, 0, 100)
    assert p.token.token_id == 7 and p.top == ()


def test_allowed_token_ids_restrict_the_choice() -> None:
    outs = outputs(core(), EngineRequest("r", PROMPT, sampling=sampling(allowed_token_ids=(11, 12, 13), max_tokens=20)))
    assert {t for o in outs for t in o.token_ids} <= {11, 12, 13}


def test_logit_bias_forces_and_bans() -> None:
    forced = outputs(core(), EngineRequest("r", PROMPT, sampling=sampling(logit_bias=((42, 100.0),))))
    assert [t for o in forced for t in o.token_ids] == [42] * 4
    banned = sampling(allowed_token_ids=(5, 6), logit_bias=((5, -100.0),), max_tokens=12)
    assert {t for o in outputs(core(), EngineRequest("r", PROMPT, sampling=banned)) for t in o.token_ids} == {6}
    mild = sampling(logit_bias=((42, 5.0),), seed=1, temperature=1.0)
    plain = sampling(seed=1, temperature=1.0)
    got = [outputs(core(), EngineRequest("r", PROMPT, sampling=s)) for s in (mild, plain)]
    assert tokens_by_index(got[0]) == tokens_by_index(got[1])  # a small bias shifts no synthetic choice


def test_bad_words_are_never_completed() -> None:
    tok = ByteTokenizer()
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    c = core(encode=tok.encode)
    s = sampling(allowed_token_ids=(a, b), bad_words=("ab",), max_tokens=40, temperature=1.0)
    out = [t for o in outputs(c, EngineRequest("r", PROMPT, sampling=s)) for t in o.token_ids]
    assert a in out and all((x, y) != (a, b) for x, y in itertools.pairwise(out))
    with pytest.raises(InvalidArgument) as exc:
        core().add_request(EngineRequest("r", PROMPT, sampling=s), 0.0)
    assert exc.value.field == "bad_words"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"structured_output": StructuredOutput(json_object=True)}, "structured_outputs"),
        ({"allowed_token_ids": (10**9,)}, "allowed_token_ids"),
        ({"logit_bias": ((10**9, 1.0),)}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_refused_with_the_field_named(kw: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        core().add_request(EngineRequest("r", PROMPT, sampling=sampling(**kw)), 0.0)
    assert exc.value.field == field


async def test_the_driver_streams_every_sequence_then_ends() -> None:
    eng = SimEngine(SimConfig(block_size=BS, num_blocks=256), clock=VirtualClock())
    await eng.start()
    try:
        req = EngineRequest("r", PROMPT, sampling=sampling(n=2, temperature=1.0, logprobs=1))
        outs = [o async for o in eng.generate(req)]
        assert sorted(o.index for o in outs if o.finished) == [0, 1]
        assert all(o.text and len(o.logprobs) == 1 for o in outs)
        assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 8
    finally:
        await eng.stop()
