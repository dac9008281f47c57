"""OpenAI response shapes: choices with their indexes, chat and completions log-probabilities and vLLM's
`prompt_logprobs` as vLLM's server writes them."""

from __future__ import annotations

import pytest

from kvmesh.core.generation import PositionLogprobs, TokenLogprob
from kvmesh.openai.responses import (
    Choice,
    CompletionLogprobs,
    ResponseBuilder,
    chat_logprobs,
    merge_completion_logprobs,
    prompt_logprobs_json,
)

pytestmark = pytest.mark.unit


def decode(token_id: int) -> str:
    return {1: "a", 2: "bc", 3: "é"}.get(token_id, f"<{token_id}>")


def entry(token: int, lp: float, *top: tuple[int, float]) -> PositionLogprobs:
    return PositionLogprobs(
        TokenLogprob(token, lp, 1), tuple(TokenLogprob(t, x, i + 2) for i, (t, x) in enumerate(top))
    )


def test_chat_logprobs_shape() -> None:
    lp = chat_logprobs([entry(3, -0.5, (1, -1.0)), entry(2, float("-inf"))], decode)
    assert lp == {
        "content": [
            {
                "token": "é",
                "logprob": -0.5,
                "bytes": [195, 169],
                "top_logprobs": [{"token": "a", "logprob": -1.0, "bytes": [97]}],
            },
            {"token": "bc", "logprob": -9999.0, "bytes": [98, 99], "top_logprobs": []},  # -inf as OpenAI writes it
        ]
    }


def test_completion_logprobs_shape_and_offsets_run_on_across_chunks() -> None:
    lp = CompletionLogprobs(decode)
    first = lp.add([1, 2], [None, entry(2, -0.25, (1, -2.0))])  # an echoed prompt: its first token has none
    second = lp.add([3], [entry(3, -0.5)])
    assert first == {
        "tokens": ["a", "bc"],
        "token_logprobs": [None, -0.25],
        "top_logprobs": [None, {"bc": -0.25, "a": -2.0}],  # the sampled token and the alternatives
        "text_offset": [0, 1],
    }
    assert second["text_offset"] == [3] and second["top_logprobs"] == [{"é": -0.5}]
    merged = merge_completion_logprobs([first, second])
    assert merged is not None and merged["tokens"] == ["a", "bc", "é"] and merged["text_offset"] == [0, 1, 3]
    assert merge_completion_logprobs([]) is None


def test_whole_choices_in_index_order_with_their_logprobs() -> None:
    chat = ResponseBuilder("id", chat=True, created=1, model="m")
    body = chat.whole_choices([Choice(1, "y", "length"), Choice(0, "x", "stop", {"content": []})], None)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0] == {
        "index": 0,
        "finish_reason": "stop",
        "logprobs": {"content": []},
        "message": {"role": "assistant", "content": "x"},
    }
    assert body["choices"][1]["logprobs"] is None and body["object"] == "chat.completion"
    text = ResponseBuilder("id", chat=False, created=1, model="m")
    assert text.whole("z", "stop", None)["choices"] == [
        {"index": 0, "finish_reason": "stop", "logprobs": None, "text": "z"}
    ]


def test_stream_chunks_name_their_choice() -> None:
    chat = ResponseBuilder("id", chat=True, created=1, model="m")
    c = chat.chunk("hi", None, first=True, index=3, logprobs={"content": []})
    assert c["choices"] == [
        {
            "index": 3,
            "finish_reason": None,
            "logprobs": {"content": []},
            "delta": {"role": "assistant", "content": "hi"},
        }
    ]
    text = ResponseBuilder("id", chat=False, created=1, model="m")
    assert text.chunk("", "stop", first=False, index=1)["choices"] == [
        {"index": 1, "finish_reason": "stop", "logprobs": None, "text": ""}
    ]


def test_prompt_logprobs_in_vllms_shape() -> None:
    """vLLM's list: null first, then {id: {logprob, rank, decoded_token}}, the prompt's token first (ranked 3
    here), then the top by rank; a prompt token among the top is listed once, -inf as -9999.0."""
    low = PositionLogprobs(TokenLogprob(2, -2.0, 3), (TokenLogprob(1, -0.1, 1), TokenLogprob(3, -1.0, 2)))
    top = PositionLogprobs(TokenLogprob(1, float("-inf"), 1), (TokenLogprob(1, float("-inf"), 1),))
    got = prompt_logprobs_json([None, low, top], decode)
    assert got == [
        None,
        {
            "2": {"logprob": -2.0, "rank": 3, "decoded_token": "bc"},
            "1": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
            "3": {"logprob": -1.0, "rank": 2, "decoded_token": "é"},
        },
        {"1": {"logprob": -9999.0, "rank": 1, "decoded_token": "a"}},
    ]
    assert [list(p) for p in got[1:] if p is not None] == [["2", "1", "3"], ["1"]]  # the order vLLM's dict has


def test_prompt_logprobs_placed_as_vllm_places_them() -> None:
    plp = prompt_logprobs_json([None, entry(1, -0.5)], decode)
    text = ResponseBuilder("id", chat=False, created=1, model="m")
    body = text.whole_choices([Choice(0, "x", "stop", None, plp), Choice(1, "y", "stop")], None)
    assert body["choices"][0]["prompt_logprobs"] == plp  # a completions choice: its prompt's
    assert "prompt_logprobs" not in body["choices"][1] and "prompt_logprobs" not in body  # not asked: no key
    chat = ResponseBuilder("id", chat=True, created=1, model="m")
    body = chat.whole_choices([Choice(0, "x", "stop")], None, plp)
    assert body["prompt_logprobs"] == plp and "prompt_logprobs" not in body["choices"][0]  # chat: at the top
    assert "prompt_logprobs" not in chat.whole_choices([Choice(0, "x", "stop")], None)
