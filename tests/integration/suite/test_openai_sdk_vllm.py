"""The official `openai` SDK and `kvmesh.client` against one `kvmesh up --engine vllm` suite, as an application
uses them: one suite (a cache-manager, one real vLLM worker on the tiny model, a router with the hermes tool
parser, a failover service; planner off), started by the CLI once for the module and stopped with
`kvmesh down`; every call carries the suite's own client credential (`run/auth/client-demo.token`).

Over HTTP with the SDK: chat, streamed chat with `include_usage`, `n`, log-probabilities (chat and
completions), `chat.completions.parse` with a Pydantic model, tools (`required`, a named function, `auto`),
a completions batch, `echo`, `min_p`, `logit_bias`, and a bad value refused with a 400 naming its field.
Over gRPC with `kvmesh.client` (through the failover service's endpoint sets): `n`, log-probabilities, a
JSON-schema structured output, `min_p`, `logit_bias`, a bad value refused naming its field. `RouterService`
has no batch, no `echo` and no tools (a request is one prompt; a chat message is a role and a text), so
those are HTTP-only.

The model's weights are random: the structured outputs and forced tool calls suppress the whitespace tokens
(`logit_bias` -100) so that greedy decoding fills the schema within a few dozen tokens instead of padding it
with tabs; their assertions are then exact, and a constraint the engine ignored would fail them. `min_p=1`
keeps only the most likely token, so seeded sampling with it must equal greedy decoding (and, the control,
differ without it). A handful of tokens per request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import BaseModel

from kvmesh.client import Client
from kvmesh.rpc.errors import invalid_field
from kvmesh.v1 import common_pb2, router_pb2
from tests.support.cli import kvmesh_cli
from tests.support.models import tiny_model
from tests.support.scrape import metric

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
# TORCHDYNAMO_DISABLE: vLLM's sampler runs its few `torch.compile`d helpers (the logprob ranks, the random
# sampling) eagerly, the same arithmetic, instead of compiling them with a C++ toolchain on first use (~20 s
# of CPU on this host, more than every request of the module together); the model itself runs eager anyway
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1"}
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
# what the n=2 tests' check of no migration says when it fails: the router's handle of a worker call must end
# at the last sequence's finish, not the first (services/router/stream_requests.py)
MIGRATED = "n=2 migrated a sequence: the worker call was taken as over at its first sequence's finish"
BIASED = 1000  # a token id of the tiny model's 1024-token vocabulary, its text read back with /detokenize
CITY = {"type": "string", "enum": ["Paris", "Rome"]}
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


class Weather(BaseModel):
    """The structured output: enums and a boolean only, so that a filled schema is a few dozen tokens."""

    city: Literal["Paris", "Rome"]
    sunny: bool


@dataclass
class Suite:
    sdk: openai.OpenAI
    http: httpx.Client  # the router's vLLM routes beside the SDK's (/tokenize, /detokenize, /metrics)
    grpc: Client  # kvmesh.client, following the suite's failover service
    model: str
    http_port: int
    no_whitespace: dict[str, int]  # logit_bias keeping whitespace tokens out of a grammar's padding

    def tokens(self, **body: Any) -> list[int]:
        r = self.http.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        return list(r.json()["tokens"])

    def text_of(self, ids: list[int]) -> str:
        r = self.http.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200, r.text
        return str(r.json()["prompt"])

    def generate(self, **sampling: Any) -> list[router_pb2.RouterServiceGenerateResponse]:
        """One gRPC chat request ("hi") with `sampling`, every message of its stream."""
        chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")])
        req = router_pb2.RouterServiceGenerateRequest(chat=chat, sampling=common_pb2.SamplingParams(**sampling))
        return list(self.grpc.generate(req))


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    home = tmp_path_factory.mktemp("sdk") / "home"
    flags = ["--detach", "--ports", "auto", "--workers", "1", "--engine", "vllm", "--model", tiny_model()]
    flags += ["--set", "model.toolCallParser=hermes", "--set", "worker.maxModelLen=1024"]
    flags += ["--set", "planner.enabled=false"]  # the planner is not under test here: its CPU goes to vLLM
    try:
        # a start that fails stops what it started; one cut short here leaves its state for `down` below
        up = kvmesh_cli(home, "up", *flags, env=ENV, timeout=400)
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((home / "run" / "suite.json").read_text())
        by_name = {s["name"]: s for s in state["services"]}
        token = Path(state["auth"]["tokens"]["client"]).read_text().strip()
        port = int(by_name["router"]["http_port"])
        base = f"http://127.0.0.1:{port}"
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=token, timeout=60, max_retries=0)
        auth = {"Authorization": f"Bearer {token}"}
        with (
            sdk,
            httpx.Client(base_url=base, headers=auth, timeout=60) as http,
            Client([by_name["failover"]["grpc"]], timeout_s=60, api_key=token) as client,
        ):
            s = Suite(sdk, http, client, sdk.models.list().data[0].id, port, {})
            s.no_whitespace = {str(t): -100 for t in s.tokens(prompt=" \t\n\r")}
            yield s
    finally:
        down = kvmesh_cli(home, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr


# -- HTTP: the openai SDK -------------------------------------------------------------------------------


def test_chat(suite: Suite) -> None:
    r = suite.sdk.chat.completions.create(model=suite.model, messages=HI, max_tokens=4)
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.model == suite.model
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens == len(suite.tokens(messages=HI))
    assert 1 <= r.usage.completion_tokens <= 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_ends_with_the_usage_counting_its_tokens(suite: Suite) -> None:
    stream = suite.sdk.chat.completions.create(
        model=suite.model,
        messages=HI,
        max_tokens=4,
        logprobs=True,  # one entry per token: counts what the stream carried
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *deltas, last = chunks
    assert last.choices == [] and last.usage is not None, last
    assert all(c.usage is None for c in deltas)
    streamed = sum(len(c.choices[0].logprobs.content or []) for c in deltas if c.choices[0].logprobs)
    assert [c.choices[0].finish_reason for c in deltas][-1] in ("stop", "length")
    assert last.usage.completion_tokens == streamed and 1 <= streamed <= 4
    assert last.usage.prompt_tokens == len(suite.tokens(messages=HI))


def test_n_is_two_choices_from_one_attempt(suite: Suite) -> None:
    migrated = metric(suite.http_port, "kvmesh_migrations_total")
    r = suite.sdk.chat.completions.create(
        model=suite.model,
        messages=HI,
        max_tokens=3,
        n=2,
        logprobs=True,
    )
    assert [c.index for c in r.choices] == [0, 1]
    counted = [len(c.logprobs.content or []) for c in r.choices if c.logprobs]
    assert len(counted) == 2 and all(1 <= k <= 3 for k in counted)
    assert r.usage is not None and r.usage.completion_tokens == sum(counted)
    # one worker, nothing failed: both sequences come out of the one attempt, none resumed elsewhere (a
    # resumed sequence is sampled again from the prompt and its tokens so far, not the engine's own sequence)
    assert metric(suite.http_port, "kvmesh_migrations_total") == migrated, MIGRATED


def test_n_with_greedy_sampling_is_refused_naming_the_field(suite: Suite) -> None:
    # vLLM samples n > 1 sequences only with a temperature: refused at the router's door, naming the field
    with pytest.raises(openai.BadRequestError) as refused:
        suite.sdk.chat.completions.create(
            model=suite.model,
            messages=HI,
            max_tokens=2,
            n=2,
            temperature=0,
        )
    assert refused.value.status_code == 400
    assert refused.value.param in ("n", "temperature"), refused.value.message


def test_chat_logprobs_with_top_alternatives(suite: Suite) -> None:
    r = suite.sdk.chat.completions.create(
        model=suite.model,
        messages=HI,
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
    )
    (choice,) = r.choices
    assert choice.logprobs is not None and choice.logprobs.content
    assert r.usage is not None and len(choice.logprobs.content) == r.usage.completion_tokens
    for pos in choice.logprobs.content:
        assert pos.logprob <= 0 and len(pos.top_logprobs) == 3
        tops = [t.logprob for t in pos.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert pos.logprob <= tops[0]


def test_completion_logprobs(suite: Suite) -> None:
    r = suite.sdk.completions.create(model=suite.model, prompt="hello there", max_tokens=3, logprobs=2)
    (choice,) = r.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert r.usage is not None and len(lp.tokens) == r.usage.completion_tokens
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        # the 2 alternatives, and the sampled token beside them when it is not one of them (as vLLM)
        assert 2 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        assert top.get(token, logprob) == pytest.approx(logprob)


def test_parse_a_pydantic_model(suite: Suite) -> None:
    r = suite.sdk.chat.completions.parse(
        model=suite.model,
        messages=HI,
        response_format=Weather,
        max_tokens=48,
        temperature=0,
        logit_bias=suite.no_whitespace,
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content or "") == choice.message.parsed


def _call(choice: Any) -> Any:
    """The choice's one tool call of `get_weather`, its arguments valid for the function's parameters."""
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in CITY["enum"]
    return call


def test_tool_choice_required(suite: Suite) -> None:
    r = suite.sdk.chat.completions.create(
        model=suite.model,
        messages=HI,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
        logit_bias=suite.no_whitespace,
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls", choice
    _call(choice)


def test_tool_choice_a_named_function(suite: Suite) -> None:
    r = suite.sdk.chat.completions.create(
        model=suite.model,
        messages=HI,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
        logit_bias=suite.no_whitespace,
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop", choice  # a named call ends as "stop" (vLLM's answer too)
    _call(choice)


def test_tool_choice_auto(suite: Suite) -> None:
    r = suite.sdk.chat.completions.create(
        model=suite.model,
        messages=HI,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=8,
        temperature=0,
    )
    (choice,) = r.choices
    if choice.message.tool_calls:  # the hermes parser found a call in the (random-weight) model's text
        assert choice.finish_reason == "tool_calls"
        for c in choice.message.tool_calls:
            assert c.type == "function" and c.function.name == "get_weather" and c.id, c
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert r.usage is not None and r.usage.prompt_tokens > len(suite.tokens(messages=HI)) + 50  # the tools prompt


def test_completions_batch_choices_per_prompt(suite: Suite) -> None:
    prompts = ["alpha one", "bravo two"]
    r = suite.sdk.completions.create(model=suite.model, prompt=prompts, max_tokens=2, n=2, echo=True)
    # choice i * n + j: the j-th sequence of prompt i (echo shows which prompt each one continues)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text.startswith(prompts[c.index // 2]), (c.index, c.text)
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(len(suite.tokens(prompt=p)) for p in prompts)
    assert 4 <= r.usage.completion_tokens <= 8


def test_echo_starts_with_the_prompt(suite: Suite) -> None:
    r = suite.sdk.completions.create(model=suite.model, prompt="hello there", max_tokens=2, echo=True)
    (choice,) = r.choices
    assert choice.text.startswith("hello there") and r.usage is not None and r.usage.completion_tokens >= 1


def _chat_tokens(suite: Suite, **kw: Any) -> list[str]:
    r = suite.sdk.chat.completions.create(
        model=suite.model,
        messages=HI,
        max_tokens=4,
        logprobs=True,
        **kw,
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content
    return [t.token for t in lp.content]


def test_min_p_one_samples_the_greedy_tokens(suite: Suite) -> None:
    greedy = _chat_tokens(suite, temperature=0)
    assert _chat_tokens(suite, temperature=1, seed=7, extra_body={"min_p": 1.0}) == greedy
    assert _chat_tokens(suite, temperature=1, seed=7) != greedy  # the control: the same seed without min_p


def test_logit_bias_makes_the_token_come_out(suite: Suite) -> None:
    def greedy(**kw: Any) -> openai.types.Completion:
        return suite.sdk.completions.create(
            model=suite.model, prompt="hello there", max_tokens=3, temperature=0, logprobs=0, **kw
        )

    biased = greedy(logit_bias={str(BIASED): 100}).choices[0]
    assert biased.logprobs is not None and biased.logprobs.tokens
    assert biased.logprobs.tokens == [suite.text_of([BIASED])] * 3
    assert biased.text == suite.text_of([BIASED] * 3)
    assert greedy().choices[0].text != biased.text  # the control: without the bias another output


def test_a_bad_value_is_a_400_naming_the_field(suite: Suite) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        suite.sdk.chat.completions.create(
            model=suite.model,
            messages=HI,
            max_tokens=2,
            temperature=5,
        )
    assert refused.value.status_code == 400 and refused.value.param == "temperature"
    assert "temperature" in refused.value.message


# -- gRPC: kvmesh.client --------------------------------------------------------------------------------


def _by_index(msgs: list[router_pb2.RouterServiceGenerateResponse]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in msgs:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out


def test_grpc_n(suite: Suite) -> None:
    msgs = suite.generate(max_tokens=3, n=2, temperature=1.0)
    seqs = _by_index(msgs)
    assert sorted(seqs) == [0, 1] and all(1 <= len(t) <= 3 for t in seqs.values())
    finished = sorted(m.index for m in msgs if m.finish_reason)
    assert finished == [0, 1]
    assert msgs[-1].usage.completion_tokens == sum(len(t) for t in seqs.values())
    assert [m.migrations for m in msgs] == [0] * len(msgs), MIGRATED


def test_grpc_n_with_greedy_sampling_is_refused_naming_the_field(suite: Suite) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        suite.generate(max_tokens=2, n=2)  # temperature 0, the proto's default: greedy
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid_field(refused.value) in ("n", "temperature"), refused.value.details()


def test_grpc_logprobs(suite: Suite) -> None:
    msgs = suite.generate(max_tokens=3, logprobs=3)
    assert sum(len(m.token_ids) for m in msgs) == msgs[-1].usage.completion_tokens >= 1
    for m in msgs:
        assert len(m.logprobs) == len(m.token_ids)
        for tok, pos in zip(m.token_ids, m.logprobs, strict=True):
            assert pos.token.token_id == tok and pos.token.logprob <= 0
            assert len(pos.top) == 3 and [t.rank for t in pos.top] == [1, 2, 3]
            assert all(t.logprob <= 0 for t in pos.top) and pos.token.logprob <= pos.top[0].logprob


def test_grpc_json_schema_structured_output(suite: Suite) -> None:
    so = common_pb2.StructuredOutput(json_schema=json.dumps(Weather.model_json_schema()))
    bias = {int(k): float(v) for k, v in suite.no_whitespace.items()}
    msgs = suite.generate(max_tokens=48, temperature=0, structured_output=so, logit_bias=bias)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    Weather.model_validate_json("".join(m.text for m in msgs))


def test_grpc_min_p_one_samples_the_greedy_tokens(suite: Suite) -> None:
    greedy = _by_index(suite.generate(max_tokens=4, temperature=0))[0]
    assert _by_index(suite.generate(max_tokens=4, temperature=1, seed=7, min_p=1.0))[0] == greedy
    assert _by_index(suite.generate(max_tokens=4, temperature=1, seed=7))[0] != greedy  # the control


def test_grpc_logit_bias(suite: Suite) -> None:
    assert _by_index(suite.generate(max_tokens=3, temperature=0, logit_bias={BIASED: 100}))[0] == [BIASED] * 3
    assert _by_index(suite.generate(max_tokens=3, temperature=0))[0] != [BIASED] * 3  # the control


def test_grpc_bad_value_is_refused_naming_the_field(suite: Suite) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        suite.generate(max_tokens=2, temperature=1, min_p=2.0)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid_field(refused.value) == "min_p", refused.value.details()
