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
_ENGINE_LOGPROBS = "the engines' log-probabilities (the simulated engine's are synthetic: docs/engine-model.md)"
_NO_LOGPROBS = _ENGINE_LOGPROBS + " in OpenAI's `logprobs` object"
_ENGINE = "applied by the workers' engines (vLLM's sampling; the simulated engine's: docs/engine-model.md)"
# the most prompts one completions request may carry (vLLM's VLLM_MAX_COMPLETION_PROMPTS default)
MAX_PROMPTS = 1024
_TOOLS_DOC = "docs/openai-compatibility.md#tool-calls"


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
          "model); `name`, an assistant's `tool_calls` (arguments: a JSON object's text) and a tool message's "
          "`tool_call_id` go to the chat template as vLLM passes them; any other message key is refused "
          "naming it", None),
    Field("prompt", COMPLETIONS, "supported", "text, token ids, or a list of either: a batch of up to "
          f"{MAX_PROMPTS} prompts (as vLLM), each routed on its own prefix, choice `i * n + j` the `j`th "
          "sequence of prompt `i`", None),
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
    Field("n", BOTH, "supported", "[1, 16] choices, the sequences of one prompt on one worker (they share its "
          "KV)", 2),
    Field("best_of", COMPLETIONS, "off only", "vLLM 0.32's server has no `best_of` (it ignores the key and "
          "returns `n` sequences); kvmesh takes only 1 rather than ignore another value", 2, off=(1,)),
    Field("logprobs", CHAT, "supported", "a boolean; with `true`, `top_logprobs` alternatives (0 by default): "
          + _NO_LOGPROBS, True),
    Field("logprobs", COMPLETIONS, "supported", "[0, 20] alternatives besides the sampled token (0: the "
          "sampled token's alone): " + _NO_LOGPROBS, 1),
    Field("top_logprobs", CHAT, "supported", "[0, 20], only with `logprobs: true` (as vLLM): " + _NO_LOGPROBS, 0),
    Field("echo", COMPLETIONS, "supported", "each choice starts with its prompt's text (and, with `logprobs`, "
          "the prompt's log-probabilities), as vLLM", True),
    Field("suffix", COMPLETIONS, "refused", "vLLM: \"suffix is only supported for models with FIM completion "
          "rendering\"; the served model has none (vLLM refuses even \"\")", "end"),
    Field("logit_bias", BOTH, "supported", "token id (a string key) -> bias, clamped to [-100, 100] as vLLM, ids "
          "within the vocabulary; " + _ENGINE, {"5": 1}),
    Field("response_format", BOTH, "supported", "`text`, `json_object`, or `json_schema` with "
          "`json_schema.schema` (an object): vLLM workers' structured outputs; a simulated worker refuses a "
          "constraint (400)", {"type": "json_object"}),
    Field("tools", CHAT, "supported", "function tools, rendered by the model's chat template (`[]` is refused, "
          "as vLLM); see " + _TOOLS_DOC, [{"type": "function",
          "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]),
    Field("tool_choice", CHAT, "supported", "`none` (text), `auto` (the router's `--tool-call-parser` reads "
          "the calls from the text; without one: 400, as vLLM), `required` or a named function (the output "
          "constrained to vLLM's tool-call schema by the workers' structured outputs); see " + _TOOLS_DOC,
          "none"),
    Field("parallel_tool_calls", CHAT, "supported", "`false`: at most one tool call (as vLLM)", False),
    Field("functions", CHAT, "refused", "deprecated form of `tools`, which vLLM's server does not serve "
          "either (it drops the key): use `tools`", [{"name": "f"}]),
    Field("function_call", CHAT, "refused", "deprecated form of `tool_choice`, not served by vLLM either: use "
          "`tool_choice`", "auto"),
    Field("store", CHAT, "off only", "kvmesh stores no completions", True, off=(False,)),
    Field("metadata", CHAT, "refused", "only meaningful with `store`", {"k": "v"}),
    Field("modalities", CHAT, "off only", "text output only", ["text", "audio"], off=(["text"],)),
    Field("audio", CHAT, "refused", "text output only", {"voice": "alloy", "format": "wav"}),
    Field("prediction", CHAT, "refused", "no predicted-output decoding", {"type": "content", "content": "x"}),
    Field("reasoning_effort", CHAT, "refused", "the served model has no reasoning mode", "low"),
    Field("service_tier", CHAT, "off only", "one tier", "flex", off=("auto", "default")),
    Field("web_search_options", CHAT, "refused", "no web search", {}),
    Field("chat_template_kwargs", CHAT, "supported", "extra variables of the model's chat template (those it "
          "reads; `chat_template` and `tokenize` are refused, as vLLM)", {"enable_thinking": False},
          origin="vLLM"),
    Field("add_generation_prompt", CHAT, "supported", "the assistant's header after the messages (default "
          "`true`)", False, origin="vLLM"),
    Field("continue_final_message", CHAT, "supported", "the final message left open for the model to continue; "
          "only with `add_generation_prompt: false` (as vLLM)", False, origin="vLLM"),
    Field("chat_template", CHAT, "refused", "a request's own template: vLLM refuses it too unless started with "
          "`--trust-request-chat-template`; the router renders the model's", "{{ messages }}", origin="vLLM"),
    Field("top_k", BOTH, "supported", "-1 or 0: off", 5, origin="vLLM"),
    Field("min_tokens", BOTH, "supported", "at most `max_tokens`", 1, origin="vLLM"),
    Field("stop_token_ids", BOTH, "supported", "ids within the model's vocabulary", [2], origin="vLLM"),
    Field("ignore_eos", BOTH, "supported", "boolean", True, origin="vLLM"),
    Field("repetition_penalty", BOTH, "supported", "(0, 2]", 1.1, origin="vLLM"),
    Field("session_id", BOTH, "supported", "the session-affinity key, as `user`", "s1", origin="vLLM"),
    Field("min_p", BOTH, "supported", "[0, 1]; " + _ENGINE, 0.1, origin="vLLM"),
    Field("skip_special_tokens", BOTH, "supported", "a boolean (default `true`); " + _ENGINE, False,
          origin="vLLM"),
    Field("prompt_logprobs", BOTH, "supported", "[0, 20] alternatives per prompt position; not with `stream` "
          "(a value above 0, as vLLM): vLLM's `prompt_logprobs`, a completions choice's (its prompt's) or a chat "
          "answer's (at the top): null for the first position, then {token id: {`logprob`, `rank`, "
          "`decoded_token`}}, the prompt's token first: " + _ENGINE_LOGPROBS, 1, origin="vLLM"),
    Field("bad_words", BOTH, "supported", "a list of non-empty strings; " + _ENGINE, ["the"], origin="vLLM"),
    Field("allowed_token_ids", BOTH, "supported", "a non-empty list of token ids within the vocabulary (vLLM "
          "refuses `[]`); " + _ENGINE, [2, 3], origin="vLLM"),
    Field("include_stop_str_in_output", BOTH, "supported", "a boolean; " + _ENGINE, True, origin="vLLM"),
    Field("structured_outputs", BOTH, "supported", "exactly one of `json` (a schema, or its JSON text), `regex`, "
          "`choice`, `grammar`, `json_object` (vLLM's StructuredOutputsParams; its other options only at their "
          "defaults): vLLM workers' structured outputs; a simulated worker refuses them (400)", {"regex": "[ab]+"},
          origin="vLLM"),
    Field("priority", BOTH, "supported", "an integer in [-2**31, 2**31) (kvmesh's wire is int32), lower first, "
          "first come first served within one, as vLLM's `--scheduling-policy priority`: the router's admission "
          "queue grants its waiting requests so and the vLLM workers' schedulers run with that policy (the "
          "simulated engine's own queue ignores it: docs/engine-model.md)", 1, origin="vLLM"),
    # what sglang-router adds to every request it forwards, at these values
    Field("no_stop_trim", BOTH, "off only", "a matched stop string is always trimmed from the text", True,
          off=(False,), origin="SGLang"),
    Field("return_hidden_states", BOTH, "off only", "the worker returns no hidden states", True,
          off=(False,), origin="SGLang"),
)  # fmt: skip
UNKNOWN_WHY = (
    "any other field (vLLM's other extensions: `use_beam_search`, `length_penalty`, "
    "`truncate_prompt_tokens`, `logprob_token_ids` ...; a typo) is "
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
