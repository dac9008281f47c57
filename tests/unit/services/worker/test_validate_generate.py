"""The worker's door: the sampling fields beyond OpenAI's basics are checked before any engine, pull or
batching window sees the request, and the refusal names the field."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.services.worker.servicer import validate_generate
from kvmesh.v1 import common_pb2, worker_pb2

pytestmark = pytest.mark.unit


def request(**sampling: object) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id="r", token_ids=common_pb2.TokenIds(ids=[1, 2]), sampling=common_pb2.SamplingParams(**sampling)
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"n": 17}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"structured_output": common_pb2.StructuredOutput(json_schema="[1]")}, "structured_outputs.json"),
    ],
)
def test_new_fields_are_refused_at_the_door(sampling: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        validate_generate(request(**sampling))
    assert exc.value.field == field


def test_a_request_using_them_within_bounds_passes() -> None:
    validate_generate(request(n=2, logprobs=5, min_p=0.1, logit_bias={3: 100.0}, allowed_token_ids=[3, 4]))
