"""The HTTP answer from the router's chunks (`http_choices.Choices`): one choice per sequence of each prompt
(`prompt * n + index`), usage summed over a batch's prompts, echo with the prompt's log-probabilities,
streamed chunks per choice with each one's finish."""

from __future__ import annotations

import pytest

from kvmesh.core.generation import PositionLogprobs, SamplingParams, TokenLogprob
from kvmesh.openai.responses import ResponseBuilder
from kvmesh.services.router.chunks import Chunk
from kvmesh.services.router.http_choices import Choices, PromptRun
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.request import RouterRequest
from kvmesh.v1 import common_pb2

pytestmark = pytest.mark.unit

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
LIMITS = CoreLimits(block_size=16)


def run(prompt: list[int], echo: str = "") -> PromptRun:
    req = RouterRequest.checked(LIMITS, "r", prompt, SamplingParams(max_tokens=4, n=2))
    return PromptRun(req, echo, tuple(prompt) if echo else ())


def lp(token: int) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(token, -1.0, 1))


def usage(prompt: int, completion: int) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=1)


def chunk(ids: list[int], index: int, finish: int = 0, u: common_pb2.Usage | None = None) -> Chunk:
    return Chunk(ids, "".join(chr(96 + t) for t in ids), "w", 0, finish, u, index, tuple(lp(t) for t in ids))


def test_a_batch_of_two_prompts_with_n_2_is_four_choices_and_usage_sums() -> None:
    build = ResponseBuilder("id", chat=False, created=1, model="m")
    choices = Choices(build, [run([1, 2]), run([3])], n=2, logprobs=False, decode=str)
    choices.add(1, chunk([1], 1, STOP))
    choices.add(0, chunk([2], 0, LENGTH))
    choices.add(0, chunk([3], 1, STOP, usage(2, 2)))
    choices.add(1, chunk([4, 5], 0, STOP, usage(1, 3)))
    body = choices.whole()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "b", "length"),
        (1, "c", "stop"),
        (2, "de", "stop"),  # prompt 1, sequence 0
        (3, "a", "stop"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_echo_puts_the_prompt_and_its_logprobs_before_each_choice() -> None:
    build = ResponseBuilder("id", chat=False, created=1, model="m")
    choices = Choices(build, [run([1, 2], echo="ab")], n=2, logprobs=True, decode=lambda t: chr(96 + t))
    first = chunk([3], 0)
    first.prompt_logprobs = (None, lp(2))
    choices.add(0, first)
    choices.add(0, chunk([4], 1, STOP))
    choices.add(0, chunk([], 0, STOP, usage(2, 2)))
    body = choices.whole()
    for c, tail in zip(body["choices"], ("c", "d"), strict=True):
        assert c["text"] == "ab" + tail
        assert c["logprobs"]["tokens"] == ["a", "b", tail]
        assert c["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
        assert c["logprobs"]["text_offset"] == [0, 1, 2]


def test_streamed_chunks_name_their_choice_and_each_choice_finishes() -> None:
    build = ResponseBuilder("id", chat=True, created=1, model="m")
    choices = Choices(build, [run([1])], n=2, logprobs=True, decode=lambda t: chr(96 + t))
    out = [choices.step(0, c) for c in (chunk([1], 0), chunk([2], 1), chunk([], 0, STOP), chunk([3], 1, LENGTH))]
    got = [(o["choices"][0]["index"], o["choices"][0]["delta"], o["choices"][0]["finish_reason"]) for o in out if o]
    assert got == [
        (0, {"role": "assistant", "content": "a"}, None),
        (1, {"role": "assistant", "content": "b"}, None),
        (0, {"content": ""}, "stop"),
        (1, {"content": "c"}, "length"),
    ]
    assert out[0] is not None and out[0]["choices"][0]["logprobs"]["content"][0]["token"] == "a"
