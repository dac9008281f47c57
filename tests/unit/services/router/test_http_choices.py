"""The HTTP answer from the router's chunks (`http_choices.Choices`): one choice per sequence of each prompt
(`prompt * n + index`), usage summed over a batch's prompts, echo with the prompt's log-probabilities,
vLLM's `prompt_logprobs` where vLLM puts them, streamed chunks per choice with each one's finish."""

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


def run(prompt: list[int], echo: str = "", prompt_logprobs: int | None = None) -> PromptRun:
    sampling = SamplingParams(max_tokens=4, n=2, prompt_logprobs=prompt_logprobs)
    req = RouterRequest.checked(LIMITS, "r", prompt, sampling)
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


def test_prompt_logprobs_each_completion_choice_its_prompts_a_chat_answer_at_the_top() -> None:
    build = ResponseBuilder("id", chat=False, created=1, model="m")
    choices = Choices(build, [run([1, 2], prompt_logprobs=0), run([3], prompt_logprobs=0)], n=2, logprobs=False,
                      decode=lambda t: chr(96 + t))  # fmt: skip
    for p, t in ((0, 2), (1, 3)):
        first = chunk([t], 0)
        first.prompt_logprobs = (None, lp(t))
        choices.add(p, first)
        later = chunk([t], 0)  # a migrated attempt's (prompt + tokens so far): the first attempt's stay
        later.prompt_logprobs = (None, lp(9), lp(9))
        choices.add(p, later)
        choices.add(p, chunk([t], 1, STOP, usage(1, 1)))
    body = choices.whole()
    want = {0: [None, {"2": {"logprob": -1.0, "rank": 1, "decoded_token": "b"}}],
            1: [None, {"3": {"logprob": -1.0, "rank": 1, "decoded_token": "c"}}]}  # fmt: skip
    assert [(c["index"], c["prompt_logprobs"]) for c in body["choices"]] == [(i, want[i // 2]) for i in range(4)]
    chat = Choices(ResponseBuilder("id", chat=True, created=1, model="m"), [run([1, 2], prompt_logprobs=1)], n=2,
                   logprobs=False, decode=lambda t: chr(96 + t))  # fmt: skip
    first = chunk([2], 0, STOP)
    first.prompt_logprobs = (None, lp(2))
    chat.add(0, first)
    body = chat.whole()
    assert body["prompt_logprobs"] == want[0] and all("prompt_logprobs" not in c for c in body["choices"])
    plain = Choices(build, [run([1, 2])], n=2, logprobs=False, decode=str)
    plain.add(0, chunk([2], 0, STOP))
    assert "prompt_logprobs" not in plain.whole()["choices"][0]  # not asked for: no key, as before
