"""kvmesh's sampling fields -> vLLM's own `SamplingParams` (the installed class, no engine started), and vLLM's
log-probabilities -> kvmesh's `PositionLogprobs`."""

from __future__ import annotations

import json

import pytest

from kvmesh.core.generation import PositionLogprobs, SamplingParams, StructuredOutput, TokenLogprob
from kvmesh.engine.vllm_sampling import to_logprobs, to_position_logprobs, to_vllm_sampling

pytestmark = pytest.mark.unit
vllm = pytest.importorskip("vllm")


def test_every_field_reaches_vllm() -> None:
    from vllm.sampling_params import RequestOutputKind

    p = SamplingParams(
        max_tokens=9,
        temperature=0.5,
        n=3,
        logprobs=4,
        prompt_logprobs=2,
        min_p=0.1,
        logit_bias=((7, 5.0), (9, -100.0)),
        bad_words=("foo",),
        allowed_token_ids=(1, 2, 3),
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        stop=("x",),
        priority=2,
    )
    v = to_vllm_sampling(p, 9)
    assert isinstance(v, vllm.SamplingParams)
    assert (v.n, v.logprobs, v.prompt_logprobs, v.min_p, v.max_tokens) == (3, 4, 2, 0.1, 9)
    assert v.logit_bias == {7: 5.0, 9: -100.0} and v.bad_words == ["foo"] and v.allowed_token_ids == [1, 2, 3]
    assert v.include_stop_str_in_output and not v.skip_special_tokens and v.stop == ["x"]
    assert v.output_kind == RequestOutputKind.DELTA and v.structured_outputs is None


def test_defaults_ask_vllm_for_nothing_extra() -> None:
    v = to_vllm_sampling(SamplingParams(), 16)
    assert (v.n, v.logprobs, v.prompt_logprobs, v.min_p) == (1, None, None, 0.0)
    assert v.logit_bias is None and not v.bad_words and v.allowed_token_ids is None and v.skip_special_tokens


@pytest.mark.parametrize(
    ("ours", "field", "value"),
    [
        (StructuredOutput(json_schema=json.dumps({"type": "object"})), "json", {"type": "object"}),
        (StructuredOutput(json_object=True), "json_object", True),
        (StructuredOutput(regex="[a-z]+"), "regex", "[a-z]+"),
        (StructuredOutput(choice=("yes", "no")), "choice", ["yes", "no"]),
        (StructuredOutput(grammar='root ::= "a"'), "grammar", 'root ::= "a"'),
    ],
)
def test_structured_outputs_map_to_vllms_params(ours: StructuredOutput, field: str, value: object) -> None:
    from vllm.sampling_params import StructuredOutputsParams

    so = to_vllm_sampling(SamplingParams(structured_output=ours), 8).structured_outputs
    assert isinstance(so, StructuredOutputsParams) and getattr(so, field) == value


def test_vllm_logprobs_become_position_logprobs() -> None:
    from vllm.logprobs import Logprob

    # the sampled token (5) is outside the top 2: vLLM sends it as an extra entry
    entry = {5: Logprob(-3.0, 4, "e"), 8: Logprob(-0.2, 1, "h"), 2: Logprob(-1.5, 2, "b")}
    got = to_position_logprobs(entry, 5, 2)
    assert got == PositionLogprobs(TokenLogprob(5, -3.0, 4), (TokenLogprob(8, -0.2, 1), TokenLogprob(2, -1.5, 2)))
    assert to_position_logprobs(entry, 8, 0).top == ()
    prompt = to_logprobs([None, entry], [1, 2], 1)
    assert prompt[0] is None and prompt[1] == PositionLogprobs(TokenLogprob(2, -1.5, 2), (TokenLogprob(8, -0.2, 1),))
    assert to_logprobs([entry], [5], None) == () and to_logprobs(None, [5], 2) == ()
