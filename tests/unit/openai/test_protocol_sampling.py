"""`kvmesh.openai`'s parser: vLLM's sampling extensions, log-probabilities, batches, echo, structured outputs
and the /tokenize and /detokenize bodies, parsed into the domain types as vLLM 0.32 reads them, and a bad
value of each refused naming the field as OpenAI / vLLM name it. (Which of them the router serves end to end
is the field table's; these parse below it.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams, StructuredOutput
from kvmesh.openai import fields
from kvmesh.openai.extras import parse_detokenize, parse_tokenize
from kvmesh.openai.prompts import parse_prompts
from kvmesh.openai.protocol import parse_request
from kvmesh.openai.sampling_fields import parse_sampling
from kvmesh.openai.structured import parse_structured_output

pytestmark = pytest.mark.unit
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def sampling(body: dict[str, Any], chat: bool = False) -> SamplingParams:
    return parse_sampling(body, chat, 64, None)


def refused(fn: Any, *args: Any) -> str:
    with pytest.raises(InvalidArgument) as ei:
        fn(*args)
    return ei.value.field


def bad_sampling(body: dict[str, Any], chat: bool = False) -> str:
    return refused(parse_sampling, body, chat, 64, None)


def test_n_and_best_of() -> None:
    assert sampling({}).n == 1
    assert sampling({"n": 3}).n == 3
    assert sampling({"n": 2, "best_of": 2}).n == 2  # vLLM 0.32 has no best_of: only its no-op value
    assert bad_sampling({"n": 0}) == "n"
    assert bad_sampling({"n": "2"}) == "n"
    assert bad_sampling({"n": 99}) == "n"
    assert bad_sampling({"best_of": 3}) == "best_of"
    assert bad_sampling({"best_of": True}) == "best_of"


def test_chat_logprobs_and_top_logprobs() -> None:
    assert sampling({}, chat=True).logprobs is None
    assert sampling({"logprobs": False, "top_logprobs": 0}, chat=True).logprobs is None
    assert sampling({"logprobs": True}, chat=True).logprobs == 0
    assert sampling({"logprobs": True, "top_logprobs": 5}, chat=True).logprobs == 5
    assert bad_sampling({"top_logprobs": 2}, chat=True) == "top_logprobs"  # without logprobs: true, as vLLM
    assert bad_sampling({"logprobs": False, "top_logprobs": 2}, chat=True) == "top_logprobs"
    assert bad_sampling({"logprobs": True, "top_logprobs": 21}, chat=True) == "top_logprobs"
    assert bad_sampling({"logprobs": True, "top_logprobs": -1}, chat=True) == "top_logprobs"
    assert bad_sampling({"logprobs": 2}, chat=True) == "logprobs"


def test_completion_logprobs_and_prompt_logprobs() -> None:
    assert sampling({}).logprobs is None
    assert sampling({"logprobs": 0}).logprobs == 0
    assert sampling({"logprobs": 3}).logprobs == 3
    assert bad_sampling({"logprobs": True}) == "logprobs"
    assert bad_sampling({"logprobs": 21}) == "logprobs"
    assert sampling({"prompt_logprobs": 2}).prompt_logprobs == 2
    assert sampling({"prompt_logprobs": 0, "stream": True}).prompt_logprobs == 0
    assert bad_sampling({"prompt_logprobs": 1, "stream": True}) == "prompt_logprobs"  # as vLLM
    assert bad_sampling({"prompt_logprobs": -2}) == "prompt_logprobs"
    assert bad_sampling({"prompt_logprobs": "1"}) == "prompt_logprobs"
    # echo asks for the prompt's log-probabilities at `logprobs` when prompt_logprobs is not given (vLLM)
    assert sampling({"echo": True, "logprobs": 2}).prompt_logprobs == 2
    assert sampling({"echo": True, "logprobs": 2, "prompt_logprobs": 1}).prompt_logprobs == 1
    assert sampling({"echo": True}).prompt_logprobs is None
    chat_echo = {"echo": True, "logprobs": True, "top_logprobs": 2}  # chat has no echo row: not a completion's
    assert sampling(chat_echo, chat=True).prompt_logprobs is None


def test_min_p() -> None:
    assert sampling({"min_p": 0.25}).min_p == 0.25
    assert bad_sampling({"min_p": 1.5}) == "min_p"
    assert bad_sampling({"min_p": "0.1"}) == "min_p"


def test_logit_bias() -> None:
    assert sampling({"logit_bias": {"7": 1, "3": -2.5}}).logit_bias == ((3, -2.5), (7, 1.0))
    assert sampling({"logit_bias": {"5": 300}}).logit_bias == ((5, 100.0),)  # clamped, as vLLM
    assert sampling({"logit_bias": {}}).logit_bias == ()
    for bad in ({"x": 1}, {"-1": 1}, {"5": "1"}, {"5": True}, [5], {"٣": 1}):
        assert bad_sampling({"logit_bias": bad}) == "logit_bias", bad


def test_token_and_word_lists() -> None:
    assert sampling({"bad_words": ["a b", "c"]}).bad_words == ("a b", "c")
    assert bad_sampling({"bad_words": "a"}) == "bad_words"
    assert bad_sampling({"bad_words": [" "]}) == "bad_words"
    assert sampling({"allowed_token_ids": [4, 2]}).allowed_token_ids == (4, 2)
    assert bad_sampling({"allowed_token_ids": []}) == "allowed_token_ids"  # vLLM refuses an empty list
    assert bad_sampling({"allowed_token_ids": [-1]}) == "allowed_token_ids"
    assert bad_sampling({"allowed_token_ids": [True]}) == "allowed_token_ids"


def test_booleans_and_priority() -> None:
    sp = sampling({})
    assert (sp.include_stop_str_in_output, sp.skip_special_tokens, sp.priority) == (False, True, 0)
    sp = sampling({"include_stop_str_in_output": True, "skip_special_tokens": False, "priority": -5})
    assert (sp.include_stop_str_in_output, sp.skip_special_tokens, sp.priority) == (True, False, -5)
    assert bad_sampling({"include_stop_str_in_output": 1}) == "include_stop_str_in_output"
    assert bad_sampling({"skip_special_tokens": "no"}) == "skip_special_tokens"
    assert bad_sampling({"priority": 1.5}) == "priority"
    assert bad_sampling({"priority": 2**63}) == "priority"
    assert sampling({"priority": -(2**31)}).priority == -(2**31)  # the wire's int32, both ends
    assert sampling({"priority": 2**31 - 1}).priority == 2**31 - 1
    assert bad_sampling({"priority": 2**31}) == "priority"
    assert bad_sampling({"priority": -(2**31) - 1}) == "priority"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_response_format() -> None:
    assert parse_structured_output({"response_format": {"type": "text"}}) is None
    assert parse_structured_output({"response_format": {"type": "json_object"}}) == StructuredOutput(json_object=True)
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    got = parse_structured_output({"response_format": rf})
    assert got is not None and json.loads(got.json_schema or "") == SCHEMA
    assert sampling({"response_format": rf}).structured_output == got
    bad = {
        "response_format": [{"type": "json_schema"}, {"type": "json_schema", "json_schema": 1}],
        "response_format.type": [{"type": "xml"}, {}, {"type": "structural_tag"}],
        "response_format.json_schema.name": [{"type": "json_schema", "json_schema": {"schema": SCHEMA}}],
        "response_format.json_schema.schema": [
            {"type": "json_schema", "json_schema": {"name": "a"}},
            {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
        ],
        "response_format.json_schema.strict": [
            {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}}
        ],
        "response_format.extra": [{"type": "text", "extra": 1}],
    }
    for name, values in bad.items():
        for v in values:
            body = {"response_format": v}
            assert refused(parse_structured_output, body) == name, v
    assert refused(parse_structured_output, {"response_format": "json"}) == "response_format"


def test_structured_outputs() -> None:
    def so(value: dict[str, Any]) -> StructuredOutput | None:
        return parse_structured_output({"structured_outputs": value})

    got = so({"json": SCHEMA})
    assert got is not None and json.loads(got.json_schema or "") == SCHEMA
    assert so({"json": json.dumps(SCHEMA)}) == StructuredOutput(json_schema=json.dumps(SCHEMA))
    assert so({"regex": "[ab]+"}) == StructuredOutput(regex="[ab]+")
    assert so({"choice": ["yes", "no"]}) == StructuredOutput(choice=("yes", "no"))
    assert so({"grammar": "root ::= 'a'"}) == StructuredOutput(grammar="root ::= 'a'")
    assert so({"json_object": True, "disable_any_whitespace": False}) == StructuredOutput(json_object=True)
    bad = {
        "structured_outputs": [{}, {"regex": "a", "choice": ["a"]}, {"json_object": None}],
        "structured_outputs.choice": [{"choice": []}, {"choice": "a"}],
        "structured_outputs.regex": [{"regex": 5}],
        "structured_outputs.json": [{"json": 5}],
        "structured_outputs.json_object": [{"json_object": False}],
        "structured_outputs.disable_any_whitespace": [{"regex": "a", "disable_any_whitespace": True}],
        "structured_outputs.structural_tag": [{"structural_tag": "{}"}],
        "structured_outputs.backend": [{"regex": "a", "backend": "xgrammar"}],
    }
    for name, values in bad.items():
        for v in values:
            assert refused(so, v) == name, v
    assert bad_sampling({"structured_outputs": {"json": "[1"}}) == "structured_outputs.json"  # not JSON
    assert bad_sampling({"structured_outputs": {"json": "[1]"}}) == "structured_outputs.json"  # not an object
    # both: the same kind, response_format's wins (vLLM replaces); two different constraints are refused
    both = {"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}}
    assert parse_structured_output(both) == StructuredOutput(json_object=True)
    both["structured_outputs"] = {"regex": "a"}
    assert refused(parse_structured_output, both) == "response_format"


def test_prompt_batches() -> None:
    assert parse_prompts({"prompt": "ab"}) == ((None, "ab"),)
    assert parse_prompts({"prompt": [1, 2]}) == (((1, 2), None),)
    assert parse_prompts({"prompt": ["a", "b"]}) == ((None, "a"), (None, "b"))
    assert parse_prompts({"prompt": [[1], [2, 3]]}) == (((1,), None), ((2, 3), None))
    assert parse_prompts({"prompt": ["a", [2]]}) == ((None, "a"), ((2,), None))
    assert refused(parse_prompts, {"prompt": ["a", ""]}) == "prompt[1]"
    assert refused(parse_prompts, {"prompt": [[1], [-1]]}) == "prompt[1]"
    assert refused(parse_prompts, {"prompt": [[1], [True]]}) == "prompt[1]"
    assert refused(parse_prompts, {"prompt": []}) == "prompt"
    assert refused(parse_prompts, {"prompt": [1, "a"]}) == "prompt"
    one = parse_request({"prompt": ["only"]}, False, 64, None)
    assert (one.prompts, one.prompt_text, one.prompt_ids) == (((None, "only"),), "only", None)
    if fields.MAX_PROMPTS < 2:  # parsed, refused until the router answers a choice per prompt
        assert refused(parse_request, {"prompt": ["a", "b"]}, False, 64, None) == "prompt"
    else:
        two = parse_request({"prompt": [[1], "b"]}, False, 64, None)
        assert (two.prompts, two.prompt_ids) == ((((1,), None), (None, "b")), (1,))


def test_echo() -> None:
    assert parse_request({"prompt": "a", "echo": False}, False, 64, None).echo is False
    if fields.fields_of("completions")["echo"].support == "supported":
        assert parse_request({"prompt": "a", "echo": True}, False, 64, None).echo is True
    assert refused(parse_request, {"prompt": "a", "echo": "yes"}, False, 64, None) == "echo"
    assert refused(parse_request, CHAT | {"echo": True}, True, 64, None) == "echo"  # not a chat field here


def test_suffix_is_refused_as_vllm_does_without_fim() -> None:
    f = fields.fields_of("completions")["suffix"]
    assert f.support == "refused" and "FIM" in f.why
    assert refused(parse_request, {"prompt": "a", "suffix": "b"}, False, 64, None) == "suffix"


def test_tokenize_and_detokenize_bodies() -> None:
    t = parse_tokenize({"prompt": "hi", "model": "m", "add_special_tokens": False})
    assert (t.model, t.prompt, t.messages) == ("m", "hi", ())
    assert parse_tokenize({"prompt": ""}).prompt == ""
    chat = parse_tokenize(CHAT | {"add_generation_prompt": True, "return_token_strs": False})
    assert chat.prompt is None and len(chat.messages) == 1
    bad = [
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "add_special_tokens": True}, "add_special_tokens"),
        ({"prompt": "a", "return_token_strs": True}, "return_token_strs"),
        ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),  # a chat option
        ({"prompt": "a", "typo": 1}, "typo"),
        (CHAT | {"prompt": "a"}, "prompt"),
        (CHAT | {"continue_final_message": True}, "continue_final_message"),
        (CHAT | {"chat_template": "x"}, "chat_template"),
        ({"messages": []}, "messages"),
    ]
    for body, name in bad:
        assert refused(parse_tokenize, body) == name, body
    assert parse_detokenize({"tokens": [1, 2], "model": "m"}) == ("m", (1, 2))
    assert parse_detokenize({"tokens": []}) == ("", ())
    for body, name in [({}, "tokens"), ({"tokens": [-1]}, "tokens"), ({"tokens": [True]}, "tokens"),
                       ({"tokens": [1], "prompt": "a"}, "prompt")]:  # fmt: skip
        assert refused(parse_detokenize, body) == name, body
