"""The one table of OpenAI request fields (pure): for each field, which endpoints take it, whether kvmesh
serves it, accepts it only with its "off" value, or refuses it, and why.

`kvmesh.openai.protocol` enforces it (a field not in the table, or a refused / non-off value, is HTTP 400
naming the field), docs/openai-compatibility.md is `render_markdown()`'s output (a unit test keeps them the
same), and tests/integration/openai/test_openai_compat_vllm.py sends each row's `example` to vLLM's own server and
to the router. Nothing in a request is silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Endpoint = Literal["chat", "completions"]
Support = Literal["supported", "off only", "refused"]
BOTH: tuple[Endpoint, ...] = ("chat", "completions")
CHAT: tuple[Endpoint, ...] = ("chat",)
COMPLETIONS: tuple[Endpoint, ...] = ("completions",)
_NO_LOGPROBS = "the worker's token stream carries ids and text, no log-probabilities"
_NO_TOOLS = "no tool-call parser for the served model: the router answers text only"


@dataclass(frozen=True, slots=True)
class Field:
    """One request field. `off`: the values accepted for an "off only" field (null always is); `example`: a
    value the compatibility suite sends (for "off only" and "refused" fields one that is not off)."""

    name: str
    endpoints: tuple[Endpoint, ...]
    support: Support
    why: str
    example: object
    off: tuple[object, ...] = ()
    origin: Literal["OpenAI", "vLLM", "SGLang"] = "OpenAI"


FIELDS: tuple[Field, ...] = (
    Field("model", BOTH, "supported", "the served model or one of its LoRA adapters (another name: 404)", None),
    Field("messages", CHAT, "supported", "`role` + `content`: a string or parts of type `text`; another part "
          "type (`image_url`, `input_audio`, ...) is refused naming `messages[i].content[j].type` (a text "
          "model), so is any other message key (`name`, `tool_calls`, ...)", None),
    Field("prompt", COMPLETIONS, "supported", "text, token ids, or a one-element list of either (a batch of "
          "prompts is refused)", None),
    Field("max_tokens", BOTH, "supported", "the completion's token limit (the router's own limit caps it)", 3),
    Field("max_completion_tokens", CHAT, "supported", "OpenAI's current name for `max_tokens`; when both are "
          "given it wins, as in vLLM", 3),
    Field("temperature", BOTH, "supported", "[0, 2], vLLM's bound", 0.5),
    Field("top_p", BOTH, "supported", "(0, 1]", 0.9),
    Field("seed", BOTH, "supported", "[0, 2**63)", 7),
    Field("stop", BOTH, "supported", "a string or a list of strings", ["\n\n"]),
    Field("presence_penalty", BOTH, "supported", "[-2, 2]", 0.1),
    Field("frequency_penalty", BOTH, "supported", "[-2, 2]", 0.1),
    Field("stream", BOTH, "supported", "server-sent events ending with `data: [DONE]`", True),
    Field("stream_options", BOTH, "supported", "only with `stream: true` (as vLLM); `include_usage: true` adds "
          "a final chunk with empty `choices` and the `usage` (none otherwise); `continuous_usage_stats: true` "
          "is refused (usage is known at the end only)", {"include_usage": True}),
    Field("user", BOTH, "supported", "the session-affinity key (`X-Session-Id` wins)", "u1"),
    Field("n", BOTH, "off only", "one choice per request: the router sends one sequence to one worker", 2,
          off=(1,)),
    Field("best_of", COMPLETIONS, "off only", "one sequence per request (as `n`)", 2, off=(1,)),
    Field("logprobs", CHAT, "off only", _NO_LOGPROBS, True, off=(False,)),
    Field("logprobs", COMPLETIONS, "off only", _NO_LOGPROBS + " (0 asks for the sampled token's)", 0),
    Field("top_logprobs", CHAT, "off only", _NO_LOGPROBS, 2, off=(0,)),
    Field("echo", COMPLETIONS, "off only", "the prompt is not echoed", True, off=(False,)),
    Field("suffix", COMPLETIONS, "refused", "no insertion (fill-in-the-middle) mode; vLLM refuses even \"\" "
          "for a model without FIM rendering", "end"),
    Field("logit_bias", BOTH, "off only", "kvmesh's sampling parameters on the wire carry no bias map",
          {"5": 1}, off=({},)),
    Field("response_format", BOTH, "off only", "structured output (`json_object`, `json_schema`) needs guided "
          "decoding, which the worker call does not carry; `{\"type\": \"text\"}` is the default",
          {"type": "json_object"}, off=({"type": "text"},)),
    Field("tools", CHAT, "refused", _NO_TOOLS + " (vLLM refuses `[]` too)", [{"type": "function",
          "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]),
    Field("tool_choice", CHAT, "off only", _NO_TOOLS + " (`none` means text; vLLM refuses another value "
          "without `tools`)", "required", off=("none",)),
    Field("parallel_tool_calls", CHAT, "off only", "has no effect without `tools` (which are refused), "
          "either boolean is accepted", "yes", off=(True, False)),
    Field("functions", CHAT, "refused", "deprecated form of `tools`: " + _NO_TOOLS, [{"name": "f"}]),
    Field("function_call", CHAT, "refused", "deprecated form of `tool_choice`: " + _NO_TOOLS, "auto"),
    Field("store", CHAT, "off only", "kvmesh stores no completions", True, off=(False,)),
    Field("metadata", CHAT, "refused", "only meaningful with `store`", {"k": "v"}),
    Field("modalities", CHAT, "off only", "text output only", ["text", "audio"], off=(["text"],)),
    Field("audio", CHAT, "refused", "text output only", {"voice": "alloy", "format": "wav"}),
    Field("prediction", CHAT, "refused", "no predicted-output decoding", {"type": "content", "content": "x"}),
    Field("reasoning_effort", CHAT, "refused", "the served model has no reasoning mode", "low"),
    Field("service_tier", CHAT, "off only", "one tier", "flex", off=("auto", "default")),
    Field("web_search_options", CHAT, "refused", "no web search", {}),
    Field("top_k", BOTH, "supported", "-1 or 0: off", 5, origin="vLLM"),
    Field("min_tokens", BOTH, "supported", "at most `max_tokens`", 1, origin="vLLM"),
    Field("stop_token_ids", BOTH, "supported", "ids within the model's vocabulary", [2], origin="vLLM"),
    Field("ignore_eos", BOTH, "supported", "boolean", True, origin="vLLM"),
    Field("repetition_penalty", BOTH, "supported", "(0, 2]", 1.1, origin="vLLM"),
    Field("session_id", BOTH, "supported", "the session-affinity key, as `user`", "s1", origin="vLLM"),
    Field("min_p", BOTH, "off only", "kvmesh's sampling parameters on the wire carry no `min_p`", 0.1,
          off=(0, 0.0), origin="vLLM"),
    Field("skip_special_tokens", BOTH, "off only", "special tokens are always left out of the text", False,
          off=(True,), origin="vLLM"),
    # what sglang-router adds to every request it forwards, at these values
    Field("no_stop_trim", BOTH, "off only", "a matched stop string is always trimmed from the text", True,
          off=(False,), origin="SGLang"),
    Field("return_hidden_states", BOTH, "off only", "the worker returns no hidden states", True,
          off=(False,), origin="SGLang"),
)  # fmt: skip
UNKNOWN_WHY = (
    "any other field (vLLM's other extensions: `use_beam_search`, `length_penalty`, "
    "`chat_template`, `add_generation_prompt`, `structured_outputs`, `priority`, `bad_words` ...; a typo) is "
    "refused with 400 naming it"
)


def fields_of(endpoint: Endpoint) -> dict[str, Field]:
    """The table's rows for one endpoint, by name."""
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


def render_markdown() -> str:
    """The table as docs/openai-compatibility.md carries it."""
    lines = [
        "| field | endpoints | from | kvmesh | accepted values when off only | the suite sends | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in FIELDS:
        off = ", ".join(["`null`", *(f"`{json.dumps(v)}`" for v in f.off)]) if f.support == "off only" else ""
        support = {"supported": "supported", "off only": "off only, else 400", "refused": "400 unless null"}
        example = "" if f.example is None else f"`{json.dumps(f.example)}`"
        cells = (f"`{f.name}`", ", ".join(f.endpoints), f.origin, support[f.support], off, example, f.why)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"| *other* | chat, completions | | 400 | | `true` | {UNKNOWN_WHY} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
