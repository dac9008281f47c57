"""Parsing and validation of OpenAI completion and chat requests (pure): a JSON body in, an `OpenAIRequest`
out, or `InvalidArgument` naming the field (the HTTP `param`).

Which fields are served, which are accepted only with the value that means "off" (`n: 1`, `logprobs:
false`, `response_format: {"type": "text"}`, null ...) and which are refused is `kvmesh.openai.fields`'
table (docs/openai-compatibility.md); any field outside it is refused with InvalidArgument naming it (a typo
or a feature the client relies on is never silently ignored). Chat content is a string or parts of type
`text` (another part type is refused naming `messages[i].content[j].type`); a message may carry `name`,
`tool_calls` and `tool_call_id` for the chat template; `tools` and `tool_choice` are `kvmesh.openai.tools`'
(a forced call becomes the sampling's structured output). The sampling bounds are
`kvmesh.core.sampling`'s, the same as gRPC's. Text must be valid Unicode (a lone surrogate such as
"\\ud800", which JSON can carry but UTF-8 cannot, is refused); token ids are integers, never booleans.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams, StructuredOutput
from kvmesh.core.sampling import validate_sampling
from kvmesh.openai.fields import MAX_PROMPTS, fields_of
from kvmesh.openai.tools import forced_call_schema, parse_tool_fields

SEED_MAX = 2**63 - 1  # int64 in vLLM, uint64 on kvmesh's wire: [0, 2**63) fits both

PromptInput = tuple[tuple[int, ...] | None, str | None]  # (token ids, text): one of the two is set

STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_CALL_KEYS = frozenset({"id", "type", "function"})
ToolCallIn = tuple[str, str, str]  # a past call in the history: (id, function name, arguments as JSON text)


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message: `role`, `content` (text parts joined; "" when null), and what vLLM hands the chat
    template besides: `name`, an assistant's `tool_calls`, a tool answer's `tool_call_id`."""

    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCallIn, ...] = ()
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it; a call's arguments as an object, as vLLM passes them
        (tool-use templates expect a dict, not the JSON text of OpenAI's format)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                for i, n, a in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def chars(self) -> int:
        """Its text length, for the router's prompt-size bound before rendering."""
        calls = sum(len(i) + len(n) + len(a) for i, n, a in self.tool_calls)
        return len(self.role) + len(self.content) + len(self.name or "") + calls + len(self.tool_call_id or "")


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A parsed completion (`prompt_ids` or `prompt_text`) or chat (`messages`) request."""

    chat: bool
    sampling: SamplingParams
    model: str = ""
    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    messages: tuple[Message, ...] = field(default=())
    stream: bool = False
    include_usage: bool = False
    user: str = ""
    # a completions batch: one (ids, text) per prompt, each routed on its own prefix; `prompt_ids` /
    # `prompt_text` are the first (the only one without a batch)
    prompts: tuple[PromptInput, ...] = ()
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before the completion
    tools: tuple[dict[str, Any], ...] = ()  # chat: the `tools` as given (function definitions)
    tool_choice: str | dict[str, Any] = "none"  # "none", "auto", "required" or {"type": "function", ...}
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    parallel_tool_calls: bool = True  # false: at most one tool call (vLLM's `maxItems: 1` and its filter)


def parse_request(
    body: dict[str, Any], chat: bool, max_tokens_limit: int | None, default_max_tokens: int | None
) -> OpenAIRequest:
    """The whole request; `default_max_tokens` applies when the body gives none (None = the service's)."""
    check_fields(body, chat)
    model = parse_model(body)
    prompts = () if chat else parse_prompts(body)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidArgument("prompt", f"a batch of at most {MAX_PROMPTS} prompt(s) is served, got {len(prompts)}")
    ids, text = prompts[0] if prompts else (None, None)
    messages = parse_messages(body) if chat else ()
    stream, include_usage = parse_stream(body)
    tools, tool_choice, parallel = parse_tool_fields(body) if chat else ((), "none", True)
    template_kwargs, add_generation, continue_final = parse_template_options(body) if chat else ({}, True, False)
    return OpenAIRequest(
        chat=chat,
        sampling=forced_call_sampling(
            parse_sampling(body, chat, max_tokens_limit, default_max_tokens), tool_choice, tools, parallel
        ),
        model=model,
        prompt_ids=ids,
        prompt_text=text,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        user=_opt_str(body, "session_id") or _opt_str(body, "user"),
        prompts=prompts,
        echo=False if chat else _bool(body, "echo"),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs,
        add_generation_prompt=add_generation,
        continue_final_message=continue_final,
    )


def forced_call_sampling(
    sp: SamplingParams, tool_choice: str | dict[str, Any], tools: tuple[dict[str, Any], ...], parallel: bool
) -> SamplingParams:
    """`sp` constrained to a tool call when `tool_choice` forces one ("required", a named function): as in
    vLLM, the call's schema replaces any other output constraint (`response_format`)."""
    schema = forced_call_schema(tool_choice, tools, parallel)
    if schema is None:
        return sp
    return dataclasses.replace(sp, structured_output=StructuredOutput(json_schema=json.dumps(schema)))


def parse_template_options(body: dict[str, Any]) -> tuple[dict[str, Any], bool, bool]:
    """(`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`), checked as vLLM does:
    not both of the last two, no `chat_template` / `tokenize` among the kwargs (the template is the model's)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise InvalidArgument("chat_template_kwargs", "must be an object")
    for key in ("chat_template", "tokenize"):
        if key in kwargs:
            raise InvalidArgument(f"chat_template_kwargs.{key}", "not accepted from a request (as vLLM)")
    add = body.get("add_generation_prompt")
    cont = _bool(body, "continue_final_message")
    if add is not None and not isinstance(add, bool):
        raise InvalidArgument("add_generation_prompt", "must be a boolean")
    if cont and add is not False:  # its default is true: vLLM's template call refuses the pair then too
        raise InvalidArgument(
            "continue_final_message", "not with `add_generation_prompt` true (its default): set it to false"
        )
    return kwargs, add is not False, cont


def check_fields(body: dict[str, Any], chat: bool) -> None:
    """InvalidArgument naming the first field the endpoint's table (`kvmesh.openai.fields`) does not serve:
    one outside it, a refused one that is not null, an "off only" one with another value."""
    table = fields_of("chat" if chat else "completions")
    for key, value in body.items():
        f = table.get(key)
        if f is None:
            raise InvalidArgument(key, "unknown or unsupported field (docs/openai-compatibility.md)")
        if f.support == "supported" or value is None:
            continue
        if f.support == "refused":
            raise InvalidArgument(key, f"not supported: {f.why}")
        if not _is_off(value, f.off):
            offs = " or ".join(json.dumps(o) for o in (*f.off, None))
            raise InvalidArgument(key, f"not supported ({f.why}): only {offs} is accepted")


def _is_off(value: object, offs: tuple[object, ...]) -> bool:
    """One of `offs` of the same type (True is not 1, 0.0 is not 0)."""
    return any(type(value) is type(off) and value == off for off in offs)


def check_text(value: str, field: str) -> str:
    """`value`, or InvalidArgument when it cannot be UTF-8 encoded (a lone surrogate from a JSON escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(field, f"invalid Unicode at character {e.start} (a lone surrogate?)") from None
    return value


def parse_model(body: dict[str, Any]) -> str:
    """The `model` field ('' when absent)."""
    return _opt_str(body, "model")


def parse_prompts(body: dict[str, Any]) -> tuple[PromptInput, ...]:
    """A completion's `prompt` as one (token ids, None) or (None, text) per prompt: a string, a list of token
    ids, or a non-empty list of strings or of token-id lists (a batch, as vLLM); `prompt[i]` names a bad one."""
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        return tuple(_one_prompt(x, f"prompt[{i}]") for i, x in enumerate(p))
    return (_one_prompt(p, "prompt"),)


def _one_prompt(p: object, name: str) -> PromptInput:
    if isinstance(p, str) and p:
        return None, check_text(p, name)
    if isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p):
        return tuple(p), None
    raise InvalidArgument(name, "a non-empty string, a list of token ids, or a list of either")


def parse_messages(body: dict[str, Any]) -> tuple[Message, ...]:
    """A chat's `messages`; the text parts of a content list are joined. Besides role and content: `name`,
    an assistant's `tool_calls`, a tool message's `tool_call_id` (what vLLM passes to the chat template)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidArgument("messages", "a non-empty list of {role, content} is required")
    out = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidArgument(f"messages[{i}]", "needs a string role")
        extra = next((k for k in msg if k not in _MESSAGE_KEYS and msg[k] is not None), None)
        if extra is not None:
            raise InvalidArgument(
                f"messages[{i}].{extra}", "not supported: a message is {role, content, name, tool_calls, tool_call_id}"
            )
        role = check_text(msg["role"], f"messages[{i}].role")
        content = msg.get("content")
        if content is None:  # an assistant's answer that was only tool calls
            content = ""
        if isinstance(content, list):
            content = _text_parts(content, f"messages[{i}].content")
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append(
            Message(
                role,
                check_text(content, f"messages[{i}].content"),
                _opt_text(msg, "name", f"messages[{i}].name"),
                _tool_calls(msg.get("tool_calls"), role, f"messages[{i}].tool_calls"),
                _opt_text(msg, "tool_call_id", f"messages[{i}].tool_call_id"),
            )
        )
    return tuple(out)


def _opt_text(msg: dict[str, Any], key: str, where: str) -> str | None:
    v = msg.get(key)
    if v is not None and not isinstance(v, str):
        raise InvalidArgument(where, "must be a string")
    return None if v is None else check_text(v, where)


def _tool_calls(calls: object, role: str, where: str) -> tuple[ToolCallIn, ...]:
    """An assistant message's past `tool_calls`: [{id, type: "function", function: {name, arguments}}], the
    arguments a JSON object's text (vLLM coerces a malformed one to {}; kvmesh refuses it rather than
    render a call that was not made)."""
    if calls is None:
        return ()
    if role != "assistant":
        raise InvalidArgument(where, "only an assistant message has tool_calls")
    if not isinstance(calls, list):
        raise InvalidArgument(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise InvalidArgument(w, "must be an object")
        extra = next((k for k in call if k not in _CALL_KEYS), None)
        if extra is not None:
            raise InvalidArgument(f"{w}.{extra}", "unknown key: a tool call is {id, type, function}")
        if call.get("type", "function") != "function":
            raise InvalidArgument(f"{w}.type", 'only "function" tool calls')
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise InvalidArgument(f"{w}.function", "must be an object {name, arguments}")
        extra = next((k for k in fn if k not in ("name", "arguments")), None)
        if extra is not None:
            raise InvalidArgument(f"{w}.function.{extra}", "unknown key: a function call is {name, arguments}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument(f"{w}.function.name", "must be a non-empty string")
        args = fn.get("arguments")
        if not isinstance(args, str) or not _is_json_object(args):
            raise InvalidArgument(f"{w}.function.arguments", "must be the JSON text of an object")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise InvalidArgument(f"{w}.id", "must be a string")
        names = (f"{w}.id", f"{w}.function.name", f"{w}.function.arguments")
        out.append((check_text(call_id, names[0]), check_text(fn["name"], names[1]), check_text(args, names[2])))
    return tuple(out)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _text_parts(parts: list[Any], where: str) -> str:
    """The text of OpenAI's content parts, all of which must be `{"type": "text", "text": str}`."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise InvalidArgument(f"{where}[{j}]", "must be a content part object")
        kind = part.get("type")
        if kind != "text":
            got = json.dumps(kind) if isinstance(kind, str | None) else "a non-string"
            raise InvalidArgument(f"{where}[{j}].type", f'only "text" parts are served (a text model), got {got}')
        if not isinstance(part.get("text"), str):
            raise InvalidArgument(f"{where}[{j}].text", "must be a string")
        texts.append(check_text(part["text"], f"{where}[{j}].text"))
    return "".join(texts)


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`); options only with a stream (as vLLM), usage at the end only."""
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options", "must be an object")
    if not stream:
        raise InvalidArgument("stream_options", "only with stream: true (as vLLM)")
    for key in options:
        if key not in STREAM_OPTIONS:
            raise InvalidArgument(f"stream_options.{key}", "unknown option")
    if _bool(options, "continuous_usage_stats"):
        raise InvalidArgument("stream_options.continuous_usage_stats", "not supported: usage comes at the end")
    return stream, _bool(options, "include_usage", "stream_options.include_usage")


def parse_sampling(
    body: dict[str, Any], chat: bool, max_tokens_limit: int | None, default_max_tokens: int | None
) -> SamplingParams:
    """The sampling fields, type-checked here and range-checked by `validate_sampling` (gRPC's bounds)."""
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    _int(body, "max_tokens", None)  # typed even when max_completion_tokens wins
    seed = _int(body, "seed", None)
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise InvalidArgument("seed", f"must be in [0, {SEED_MAX}], got {seed}")
    logprobs = _logprobs(body, chat)
    sp = SamplingParams(
        max_tokens=_int(body, max_key, default_max_tokens),
        min_tokens=_int(body, "min_tokens", 0),
        temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
        presence_penalty=_float(body, "presence_penalty", 0.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0),
        n=_n(body),
        logprobs=logprobs,
        prompt_logprobs=_prompt_logprobs(body, chat, logprobs),
        min_p=_float(body, "min_p", 0.0),
        logit_bias=_logit_bias(body),
        bad_words=_strings(body, "bad_words"),
        allowed_token_ids=_allowed_token_ids(body),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        skip_special_tokens=_bool(body, "skip_special_tokens", default=True),
        structured_output=parse_structured_output(body),
        priority=_priority(body),
    )
    # the bound of the limit (and of the log-probabilities) named as the client named it
    renamed = {"max_tokens": max_key, "logprobs": "top_logprobs" if chat else "logprobs"}
    try:
        validate_sampling(sp, max_tokens_limit)
    except InvalidArgument as e:
        name = renamed.get(e.field, e.field)
        raise (InvalidArgument(name, e.message.removeprefix(f"{e.field}: ")) if name != e.field else e) from None
    return sp


def _n(body: dict[str, Any]) -> int:
    """`n` (1 by default); `best_of`, which vLLM 0.32's server no longer has (it ignores the key), only as `n`."""
    n: int = _int(body, "n", 1)
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise InvalidArgument("best_of", f"vLLM 0.32 has no best_of beyond n: only {n} (n) is accepted")
    return n


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """`SamplingParams.logprobs`: chat's `logprobs: true` with `top_logprobs` (0 by default; without
    `logprobs: true` only 0, as vLLM), or completions' `logprobs` (an integer)."""
    if not chat:
        return _int(body, "logprobs", None)
    top = _int(body, "top_logprobs", None)
    if not _bool(body, "logprobs"):
        if top:
            raise InvalidArgument("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true")
        return None
    return top or 0


def _prompt_logprobs(body: dict[str, Any], chat: bool, logprobs: int | None) -> int | None:
    """`prompt_logprobs`; a completion's `echo` asks for `logprobs`' worth of them when it is not given (as
    vLLM); not with a stream, as vLLM."""
    value = _int(body, "prompt_logprobs", None)
    if value is None and not chat and _bool(body, "echo"):
        value = logprobs
    if body.get("prompt_logprobs") and body.get("stream") is True:
        raise InvalidArgument("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`")
    return value


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"<token id>": bias} as sorted (id, bias) pairs, each bias clamped to [-100, 100] (as vLLM)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidArgument("logit_bias", "must be an object of token id -> bias")
    out = {}
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidArgument("logit_bias", f"keys must be token ids, got {key!r}")
        if not isinstance(bias, int | float) or isinstance(bias, bool):
            raise InvalidArgument("logit_bias", f"the bias of token {key} must be a number")
        out[int(key)] = min(100.0, max(-100.0, float(bias)))
    return tuple(sorted(out.items()))


def _allowed_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    """`allowed_token_ids`: absent, or a non-empty list (vLLM refuses `[]`)."""
    ids = _token_ids(body, "allowed_token_ids")
    if body.get("allowed_token_ids") == []:
        raise InvalidArgument("allowed_token_ids", "must not be empty")
    return ids


def _priority(body: dict[str, Any]) -> int:
    """`priority`: an int64, as vLLM (lower is served first)."""
    v: int = _int(body, "priority", 0)
    if not -(2**63) <= v <= SEED_MAX:
        raise InvalidArgument("priority", "must fit in 64 bits")
    return v


# vLLM's StructuredOutputsParams: one constraint each, and the options kvmesh takes only at their defaults
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_DEFAULTS: dict[str, object] = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
}
_RF_TYPES = ("text", "json_object", "json_schema")


def parse_structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The output constraint of `response_format` and vLLM's `structured_outputs` (`response_format`'s wins
    where both set one, as vLLM; two different constraints are refused)."""
    so = _structured_outputs(body.get("structured_outputs"))
    rf = _response_format(body.get("response_format"))
    if rf is not None and so is not None and rf.kind != so.kind:
        raise InvalidArgument("response_format", "only one kind of structured output: it and structured_outputs")
    return rf or so


def _response_format(rf: object) -> StructuredOutput | None:
    """`{"type": "text"}` (None), `json_object`, or `json_schema` whose `json_schema.schema` is an object."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise InvalidArgument("response_format", "must be an object")
    kind = rf.get("type")
    if kind not in _RF_TYPES:
        got = json.dumps(kind) if isinstance(kind, str | None) else "a non-string"
        raise InvalidArgument("response_format.type", f"one of {', '.join(_RF_TYPES)}, got {got}")
    extra = next((k for k in rf if k not in ("type", "json_schema")), None)
    if extra is not None:
        raise InvalidArgument(f"response_format.{extra}", "unknown key")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument("response_format", "type json_schema needs a json_schema object (as vLLM)")
    if not isinstance(spec.get("name"), str):
        raise InvalidArgument("response_format.json_schema.name", "a string is required")
    for key in ("description", "strict"):
        if spec.get(key) is not None and not isinstance(spec[key], bool if key == "strict" else str):
            raise InvalidArgument(f"response_format.json_schema.{key}", "wrong type")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidArgument("response_format.json_schema.schema", "must be a JSON schema object")
    return StructuredOutput(json_schema=json.dumps(schema))


def _structured_outputs(so: object) -> StructuredOutput | None:
    """vLLM's `structured_outputs`: exactly one of json (a schema object or its JSON text), regex, choice,
    grammar, json_object; its options only at their defaults (kvmesh's wire carries none)."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidArgument("structured_outputs", "must be an object")
    for key, value in so.items():
        if key in _SO_DEFAULTS:
            if value is not None and value != _SO_DEFAULTS[key]:
                raise InvalidArgument(f"structured_outputs.{key}", "only its default is served")
        elif key not in _CONSTRAINTS:
            raise InvalidArgument(f"structured_outputs.{key}", "unknown key")
    given = [k for k in _CONSTRAINTS if so.get(k) is not None]
    if len(given) != 1:
        raise InvalidArgument("structured_outputs", f"exactly one constraint of {', '.join(_CONSTRAINTS[:5])}")
    kind, value = given[0], so[given[0]]
    where = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, dict):
            return StructuredOutput(json_schema=json.dumps(value))
        if isinstance(value, str):
            return StructuredOutput(json_schema=check_text(value, where))
        raise InvalidArgument(where, "a JSON schema object or its JSON text")
    if kind == "json_object":
        if value is not True:
            raise InvalidArgument(where, "must be true")
        return StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidArgument(where, "must be a non-empty list of strings")
        return StructuredOutput(choice=tuple(check_text(c, where) for c in value))
    if kind == "structural_tag":
        raise InvalidArgument(where, "not supported: kvmesh's structured output has no structural tags")
    if not isinstance(value, str):
        raise InvalidArgument(where, "must be a string")
    text = check_text(value, where)
    return StructuredOutput(regex=text) if kind == "regex" else StructuredOutput(grammar=text)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict[str, Any], key: str, default: int | None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise InvalidArgument(key, "must be an integer")
    return v


def _float(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise InvalidArgument(key, "must be a number")
    return float(v)


def _bool(body: dict[str, Any], key: str, name: str = "", default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidArgument(name or key, "must be a boolean")
    return v


def _opt_str(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise InvalidArgument(key, "must be a string")
    return check_text(v or "", key)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (check_text(stop, "stop"),)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(check_text(s, "stop") for s in stop)
    raise InvalidArgument("stop", "must be a string or a list of strings")


def _strings(body: dict[str, Any], key: str) -> tuple[str, ...]:
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise InvalidArgument(key, "must be a list of strings")
    return tuple(check_text(s, key) for s in v)


def _token_ids(body: dict[str, Any], key: str) -> tuple[int, ...]:
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise InvalidArgument(key, "must be a list of token ids")
    return tuple(v)


# ---- vLLM's /tokenize and /detokenize (vLLM 0.32's TokenizeCompletionRequest | TokenizeChatRequest and
# DetokenizeRequest); the router answers with the tokens it routes with, so the options that would change
# them are taken only at the values that do not (null always)
_TOKENIZE_KEYS = frozenset({"model", "prompt", "messages"})
_TOKENIZE_AS_ROUTED: dict[str, object] = {
    "add_special_tokens": False,  # the router's encoding adds none (a chat template writes its own)
    "return_token_strs": False,  # the router's tokenizer maps ids to text, not to vocabulary strings
    "add_generation_prompt": True,
    "continue_final_message": False,
}
_TOKENIZE_CHAT_ONLY = frozenset({"add_generation_prompt", "continue_final_message"})
_TOKENIZE_CHAT_REFUSED = frozenset({"chat_template", "chat_template_kwargs", "tools", "media_io_kwargs",
                                    "mm_processor_kwargs"})  # fmt: skip


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """`/tokenize`: a prompt text (vLLM's completion form) or chat messages (its chat form)."""

    model: str
    prompt: str | None = None
    messages: tuple[Message, ...] = ()


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """A `/tokenize` body; InvalidArgument naming an unknown field, an option at a value the router's own
    tokenisation does not use, or a bad prompt / message."""
    chat = body.get("messages") is not None
    for key, value in body.items():
        if key in _TOKENIZE_KEYS or value is None:
            continue
        off = _TOKENIZE_AS_ROUTED.get(key) if chat or key not in _TOKENIZE_CHAT_ONLY else None
        if off is None:
            why = "not supported by the router's chat rendering" if chat and key in _TOKENIZE_CHAT_REFUSED else ""
            raise InvalidArgument(key, why or "unknown or unsupported field")
        if not _is_off(value, (off,)):
            raise InvalidArgument(key, f"only {json.dumps(off)} or null: the router answers with the tokens it routes")
    model = parse_model(body)
    if chat:
        if body.get("prompt") is not None:
            raise InvalidArgument("prompt", "either prompt or messages, not both")
        return TokenizeRequest(model, messages=parse_messages(body))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt", "a string (or messages) is required")
    return TokenizeRequest(model, prompt=check_text(prompt, "prompt"))


def parse_detokenize(body: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """A `/detokenize` body: (model, token ids)."""
    extra = next((k for k in body if k not in ("model", "tokens")), None)
    if extra is not None:
        raise InvalidArgument(extra, "unknown or unsupported field")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t <= SEED_MAX for t in tokens):
        raise InvalidArgument("tokens", "a list of token ids (integers >= 0) is required")
    return parse_model(body), tuple(tokens)


def require_plain_chat(parsed: OpenAIRequest) -> None:
    """InvalidArgument naming the first chat feature a server rendering only `role` + `content` cannot
    honour (a worker's own HTTP API: tools and template options are the router's)."""
    why = "served by the router (which renders the model's chat template); this endpoint renders plain chats"
    if parsed.tools:
        raise InvalidArgument("tools", why)
    if parsed.chat_template_kwargs:
        raise InvalidArgument("chat_template_kwargs", why)
    if not parsed.add_generation_prompt or parsed.continue_final_message:
        raise InvalidArgument(
            "add_generation_prompt" if not parsed.add_generation_prompt else "continue_final_message", why
        )
    for i, m in enumerate(parsed.messages):
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key):
                raise InvalidArgument(f"messages[{i}].{key}", why)
