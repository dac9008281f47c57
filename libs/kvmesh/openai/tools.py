"""Tool calling in the OpenAI chat API, as vLLM serves it (pure): the `tools` and `tool_choice` fields,
the JSON schema that forces a call (`tool_choice: "required"` or a named function, enforced by structured
outputs on the worker: `forced_call_sampling`), the answer's `tool_calls`, and the past calls an assistant
message of the history carries (`parse_past_calls`). A tool and a call are checked by one function object
reader (`_function`): the same keys rule, the same name rule.

What vLLM does, and so kvmesh:
- `tools` must be a non-empty list of `{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}`; `tool_choice` defaults to "auto" with tools, "none" without; a value other
  than "none" needs `tools`; a named function must be one of them.
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` objects, one of the
  tools each (`maxItems: 1` when `parallel_tool_calls` is false); each element becomes a tool call,
  finish_reason `tool_calls`.
- a named function: the output is constrained to the function's `parameters` schema; it is the call's
  `arguments`, finish_reason stays `stop` (OpenAI's convention, kept by vLLM).
- "auto": a tool-call parser reads the model's own syntax from the text (the router's `--tool-call-parser`,
  services/router/tool_parsing.py).
The schema mirrors vLLM's `vllm.tool_parsers.utils.get_json_schema_from_tools` (a unit test compares them):
importing vLLM here would make the router load it for every request.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams, StructuredOutput
from kvmesh.openai.values import check_keys, check_text

TOOL_CHOICES = ("none", "auto", "required")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_CALL_KEYS = frozenset({"id", "type", "function"})
_CALLED_KEYS = ("name", "arguments")
ToolCallIn = tuple[str, str, str]  # a past call in the history: (id, function name, arguments as JSON text)
_NAMED_USAGE = 'correct usage: {"type": "function", "function": {"name": "my_function"}}'


def parse_tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The request's `tools` (() when absent or null), each checked, kept as given for the chat template."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list) or not tools:
        raise InvalidArgument("tools", "must be a non-empty list (omit the field for no tools, as vLLM)")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidArgument(where, "must be an object")
        check_keys(tool, _TOOL_KEYS, where, "unknown key: a tool is {type, function}")
        if tool.get("type", "function") != "function":
            raise InvalidArgument(f"{where}.type", 'only "function" tools are served')
        fn = _function(tool.get("function"), f"{where}.function", _FUNCTION_KEYS)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidArgument(f"{where}.function.description", "must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidArgument(f"{where}.function.parameters", "must be a JSON schema object")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise InvalidArgument(f"{where}.function.strict", "must be a boolean")
    return tuple(tools)


def _function(fn: object, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """A tool's or a call's `function` object: only `keys`, a non-empty string `name`."""
    if not isinstance(fn, dict):
        raise InvalidArgument(where, "must be an object {" + ", ".join(keys) + "}")
    check_keys(fn, keys, where, "unknown key: a function is {" + ", ".join(keys) + "}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidArgument(f"{where}.name", "must be a non-empty string")
    return fn


def parse_past_calls(calls: object, role: str, where: str) -> tuple[ToolCallIn, ...]:
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
        check_keys(call, _CALL_KEYS, w, "unknown key: a tool call is {id, type, function}")
        if call.get("type", "function") != "function":
            raise InvalidArgument(f"{w}.type", 'only "function" tool calls')
        fn = _function(call.get("function"), f"{w}.function", _CALLED_KEYS)
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


def parse_tool_choice(body: dict[str, Any], tools: tuple[dict[str, Any], ...]) -> str | dict[str, Any]:
    """`tool_choice`, checked against the tools as vLLM checks it; its default: "auto" with tools, else "none"."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice == "none":
        return choice
    if not tools:
        raise InvalidArgument("tool_choice", "when using `tool_choice`, `tools` must be set")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidArgument("tool_choice", 'only a named function, "none", "auto" or "required"')
        return choice
    if not isinstance(choice, dict):
        raise InvalidArgument("tool_choice", 'only a named function, "none", "auto" or "required"')
    if choice.get("type", "function") != "function":
        raise InvalidArgument("tool_choice.type", f'must be "function" ({_NAMED_USAGE})')
    fn = choice.get("function")
    if not isinstance(fn, dict):
        raise InvalidArgument("tool_choice.function", _NAMED_USAGE)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument("tool_choice.function.name", _NAMED_USAGE)
    if name not in tool_names(tools):
        raise InvalidArgument("tool_choice", f"the function {name!r} is not one of the `tools`")
    return choice


def tool_names(tools: tuple[dict[str, Any], ...]) -> list[str]:
    """The functions' names, in the tools' order."""
    return [str(t["function"]["name"]) for t in tools]


def named_function(tool_choice: str | dict[str, Any]) -> str | None:
    """The function a named `tool_choice` forces (None for "none", "auto", "required")."""
    return str(tool_choice["function"]["name"]) if isinstance(tool_choice, dict) else None


def forced_call_schema(
    tool_choice: str | dict[str, Any], tools: tuple[dict[str, Any], ...], parallel_tool_calls: bool
) -> dict[str, Any] | None:
    """The JSON schema that makes the output a tool call ("required", a named function), else None: vLLM's
    `get_json_schema_from_tools` for chat completions."""
    params = {str(t["function"]["name"]): t["function"].get("parameters") for t in tools}
    name = named_function(tool_choice)
    if name is not None:
        return _params_or_empty_object(params[name])
    if tool_choice != "required":
        return None
    defs = _schema_defs(params)
    params = {n: {k: v for k, v in p.items() if k != "$defs"} if p else p for n, p in params.items()}
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {"name": {"type": "string", "enum": [n]}, "parameters": _params_or_empty_object(p)},
                    "required": ["name", "parameters"],
                }
                for n, p in params.items()
            ],
        },
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_call_sampling(
    sp: SamplingParams, tool_choice: str | dict[str, Any], tools: tuple[dict[str, Any], ...], parallel: bool
) -> SamplingParams:
    """`sp` constrained to a tool call when `tool_choice` forces one ("required", a named function): as in
    vLLM, the call's schema replaces any other output constraint (`response_format`)."""
    schema = forced_call_schema(tool_choice, tools, parallel)
    if schema is None:
        return sp
    return dataclasses.replace(sp, structured_output=StructuredOutput(json_schema=json.dumps(schema)))


def _params_or_empty_object(params: dict[str, Any] | None) -> dict[str, Any]:
    # a function without parameters still takes a JSON object (vLLM's rule)
    return params if params else {"type": "object", "properties": {}}


def _schema_defs(params: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The functions' `$defs`, for the array's top where their `$ref`s resolve (vLLM moves them there: the
    items keep no copy); one name with two schemas is refused."""
    out: dict[str, Any] = {}
    for name, p in params.items():
        if not p:
            continue
        defs = p.get("$defs", {})
        if not isinstance(defs, dict):
            raise InvalidArgument("tools", f"`$defs` in the parameters of tool {name!r} must be an object")
        for key, schema in defs.items():
            if key in out and out[key] != schema:
                raise InvalidArgument("tools", f"tool definition {key!r} has two schemas")
            out[key] = schema
    return out


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of an answer's `tool_calls` (OpenAI's shape; `arguments` is JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def forced_calls(
    text: str, tool_choice: str | dict[str, Any], new_id: Callable[[], str]
) -> list[dict[str, Any]] | None:
    """The tool calls of a forced output ("required": the JSON array, a named function: its arguments), or
    None when `text` is not one (a length-cut array): the answer is then the text, as it came."""
    name = named_function(tool_choice)
    if name is not None:
        return [tool_call(new_id(), name, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(
        isinstance(it, dict) and isinstance(it.get("name"), str) and "parameters" in it for it in items
    ):
        return None
    return [tool_call(new_id(), it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items]


def forced_choice(
    choice: dict[str, Any], tool_choice: str | dict[str, Any], new_id: Callable[[], str]
) -> dict[str, Any]:
    """A whole answer's choice with its forced output as `tool_calls` (content "" as vLLM's); finish_reason
    `tool_calls` for "required" when the output ended by itself, `stop` stays for a named function."""
    msg = choice.get("message") or {}
    calls = forced_calls(msg.get("content") or "", tool_choice, new_id)
    if calls is None:
        return choice
    finish = choice.get("finish_reason")
    if tool_choice == "required" and finish == "stop":
        finish = "tool_calls"
    return {**choice, "message": {**msg, "content": "", "tool_calls": calls}, "finish_reason": finish}


def parse_tool_fields(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], str | dict[str, Any], bool]:
    """(`tools`, `tool_choice`, `parallel_tool_calls`) of a chat request, checked."""
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument("parallel_tool_calls", "must be a boolean")
    if named_function(choice) is not None and body.get("structured_outputs") is not None:
        raise InvalidArgument("tool_choice", "either structured-output constraints or a named tool, not both (as vLLM)")
    return tools, choice, parallel is not False
