"""A chat request's inputs to the model's chat template (pure): its `messages` and the template options
(`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`), or `InvalidArgument` naming the
field.

Content is a string or parts of type `text` (another part type is refused naming
`messages[i].content[j].type`: a text model); a message may carry `name`, an assistant's `tool_calls`
(`kvmesh.openai.tools.parse_past_calls`) and a tool answer's `tool_call_id`, what vLLM hands the template
besides role and content; any other key with a value is refused naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.tools import ToolCallIn, parse_past_calls
from kvmesh.openai.values import bool_field, check_keys, check_text, opt_text

_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


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
        why = "not supported: a message is {role, content, name, tool_calls, tool_call_id}"
        check_keys(msg, _MESSAGE_KEYS, f"messages[{i}]", why, skip_null=True)
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
                opt_text(msg, "name", f"messages[{i}].name"),
                parse_past_calls(msg.get("tool_calls"), role, f"messages[{i}].tool_calls"),
                opt_text(msg, "tool_call_id", f"messages[{i}].tool_call_id"),
            )
        )
    return tuple(out)


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
    cont = bool_field(body, "continue_final_message")
    if add is not None and not isinstance(add, bool):
        raise InvalidArgument("add_generation_prompt", "must be a boolean")
    if cont and add is not False:  # its default is true: vLLM's template call refuses the pair then too
        raise InvalidArgument(
            "continue_final_message", "not with `add_generation_prompt` true (its default): set it to false"
        )
    return kwargs, add is not False, cont
