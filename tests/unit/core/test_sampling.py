"""kvmesh.core.sampling: the one set of sampling bounds, vLLM's, for the fields beyond OpenAI's basics."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams, StructuredOutput
from kvmesh.core.sampling import LOGPROBS_MAX, N_MAX, validate_sampling

pytestmark = pytest.mark.unit


def test_defaults_and_every_extension_within_bounds_pass() -> None:
    validate_sampling(SamplingParams(), None)
    full = SamplingParams(
        n=N_MAX,
        logprobs=LOGPROBS_MAX,
        prompt_logprobs=0,
        min_p=1.0,
        logit_bias=((0, -100.0), (5, 100.0)),
        bad_words=("no",),
        allowed_token_ids=(0, 1),
        structured_output=StructuredOutput(json_schema='{"type": "object"}'),
    )
    validate_sampling(full, None)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": N_MAX + 1}, "n"),
        ({"logprobs": LOGPROBS_MAX + 1}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": LOGPROBS_MAX + 1}, "prompt_logprobs"),
        ({"min_p": 1.0001}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"logit_bias": ((1, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((1, -100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"allowed_token_ids": (3, -1)}, "allowed_token_ids"),
        ({"bad_words": (" ",)}, "bad_words"),
        ({"structured_output": StructuredOutput()}, "structured_outputs"),
        ({"structured_output": StructuredOutput(regex="a", grammar="b")}, "structured_outputs"),
        ({"structured_output": StructuredOutput(json_schema="{")}, "structured_outputs.json"),
        ({"structured_output": StructuredOutput(json_schema="[1]")}, "structured_outputs.json"),
        ({"structured_output": StructuredOutput(choice=())}, "structured_outputs.choice"),
        ({"structured_output": StructuredOutput(choice=("a", ""))}, "structured_outputs.choice"),
        ({"structured_output": StructuredOutput(regex="")}, "structured_outputs.regex"),
    ],
)
def test_out_of_bounds_names_its_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        validate_sampling(dataclasses.replace(SamplingParams(), **change), None)
    assert exc.value.field == field


def test_structured_output_kind_names_the_one_constraint() -> None:
    assert StructuredOutput(json_object=True).kind == "json_object"
    assert StructuredOutput(choice=("a",)).kind == "choice"
    with pytest.raises(ValueError, match="exactly one"):
        _ = StructuredOutput(json_object=True, regex="x").kind
