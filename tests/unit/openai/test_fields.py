"""`kvmesh.openai.fields`: every row of the OpenAI field table is enforced by the parser as the table says
(supported, off only, refused), docs/openai-compatibility.md carries the same table, content parts,
`max_completion_tokens` and `stream_options` behave as vLLM's server does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.fields import FIELDS, Field, render_markdown
from kvmesh.openai.protocol import Message, parse_request

pytestmark = pytest.mark.unit
DOC = Path(__file__).resolve().parents[3] / "docs" / "openai-compatibility.md"
CHAT_BASE: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION_BASE: dict[str, Any] = {"prompt": "hi"}
STREAM_FIELDS = {"stream_options": {"stream": True}}  # fields that need another one beside them


def parse(body: dict[str, Any], chat: bool) -> Any:
    return parse_request(body, chat, max_tokens_limit=64, default_max_tokens=None)


def refused_field(body: dict[str, Any], chat: bool) -> str:
    with pytest.raises(InvalidArgument) as ei:
        parse(body, chat)
    return ei.value.field


def rows() -> list[tuple[Field, bool]]:
    return [(f, e == "chat") for f in FIELDS for e in f.endpoints if f.example is not None]


def body_with(f: Field, chat: bool, value: object) -> dict[str, Any]:
    return (CHAT_BASE if chat else COMPLETION_BASE) | STREAM_FIELDS.get(f.name, {}) | {f.name: value}


def test_the_doc_carries_the_table() -> None:
    assert render_markdown() in DOC.read_text(), "regenerate: python -m kvmesh.openai.fields > table"


@pytest.mark.parametrize(("f", "chat"), rows(), ids=lambda v: v.name if isinstance(v, Field) else str(v))
def test_each_row_is_enforced_as_the_table_says(f: Field, chat: bool) -> None:
    parse(body_with(f, chat, None), chat)  # null is always accepted
    if f.support == "supported":
        parse(body_with(f, chat, f.example), chat)
        return
    assert refused_field(body_with(f, chat, f.example), chat) == f.name
    for off in f.off:
        parse(body_with(f, chat, off), chat)


def test_unknown_fields_and_the_other_endpoints_fields_are_refused() -> None:
    assert refused_field(CHAT_BASE | {"use_beam_search": True}, True) == "use_beam_search"
    assert refused_field(CHAT_BASE | {"max_tokenz": 3}, True) == "max_tokenz"
    assert refused_field(COMPLETION_BASE | {"max_completion_tokens": 3}, False) == "max_completion_tokens"
    assert refused_field(COMPLETION_BASE | {"tools": []}, False) == "tools"
    assert refused_field(CHAT_BASE | {"echo": False}, True) == "echo"


def test_content_parts_text_only() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse({"messages": [{"role": "user", "content": parts}]}, True).messages == (Message("user", "ab"),)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    mixed = [{"role": "user", "content": [parts[0], image]}]
    assert refused_field({"messages": mixed}, True) == "messages[0].content[1].type"
    untyped = [{"role": "user", "content": [{"text": "a"}]}]
    assert refused_field({"messages": untyped}, True) == "messages[0].content[0].type"
    assert refused_field({"messages": [{"role": "user", "content": ["a"]}]}, True) == "messages[0].content[0]"
    named = [{"role": "user", "content": "a", "name": "bob"}]
    assert parse({"messages": named}, True).messages == (Message("user", "a", name="bob"),)
    assert (
        refused_field({"messages": [{"role": "user", "content": "a", "refusal": "x"}]}, True) == "messages[0].refusal"
    )
    unnamed = parse({"messages": [{"role": "user", "content": "a", "name": None}]}, True)
    assert unnamed.messages == (Message("user", "a"),)


def test_max_completion_tokens_wins_as_in_vllm() -> None:
    assert parse(CHAT_BASE | {"max_completion_tokens": 3}, True).sampling.max_tokens == 3
    assert parse(CHAT_BASE | {"max_completion_tokens": 3, "max_tokens": 9}, True).sampling.max_tokens == 3
    assert parse(CHAT_BASE | {"max_completion_tokens": None, "max_tokens": 9}, True).sampling.max_tokens == 9
    assert refused_field(CHAT_BASE | {"max_completion_tokens": 65}, True) == "max_completion_tokens"
    assert refused_field(CHAT_BASE | {"max_completion_tokens": "3"}, True) == "max_completion_tokens"
    assert refused_field(CHAT_BASE | {"max_completion_tokens": 3, "max_tokens": "9"}, True) == "max_tokens"


def test_stream_options() -> None:
    on = parse(CHAT_BASE | {"stream": True, "stream_options": {"include_usage": True}}, True)
    assert on.stream and on.include_usage
    off = parse(CHAT_BASE | {"stream": True, "stream_options": {"include_usage": False}}, True)
    assert off.stream and not off.include_usage
    assert not parse(CHAT_BASE | {"stream": True}, True).include_usage
    assert not parse(CHAT_BASE | {"stream": False, "stream_options": None}, True).include_usage
    bad = {
        "stream_options": {"stream": False, "stream_options": {"include_usage": True}},  # as vLLM: 400
        "stream_options.x": {"stream": True, "stream_options": {"x": 1}},
        "stream_options.include_usage": {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.continuous_usage_stats": {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream": {"stream": "yes"},
    }
    for name, extra in bad.items():
        assert refused_field(COMPLETION_BASE | extra, False) == name
    cont = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    assert parse(COMPLETION_BASE | cont, False).include_usage
