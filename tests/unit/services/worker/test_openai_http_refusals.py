"""A worker's own OpenAI HTTP API refuses what only the router's serves (`refuse_unserved`), naming the field,
rather than parse it and drop it: a batch of prompts, `echo`, `tools`, `prompt_logprobs`."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.protocol import parse_request
from kvmesh.services.worker.openai_http import refuse_unserved

pytestmark = pytest.mark.unit
TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("body", "chat", "field"),
    [
        ({"prompt": ["a", "b"]}, False, "prompt"),
        ({"prompt": "a", "echo": True}, False, "echo"),
        ({"prompt": "a", "prompt_logprobs": 0}, False, "prompt_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, True, "prompt_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "none"}, True, "tools"),
    ],
)
def test_what_only_the_router_serves_is_refused_naming_it(body: dict[str, Any], chat: bool, field: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        refuse_unserved(parse_request(body, chat, max_tokens_limit=None, default_max_tokens=16))
    assert ei.value.field == field


def test_a_plain_request_passes() -> None:
    refuse_unserved(parse_request({"prompt": "a", "priority": 2}, False, max_tokens_limit=None, default_max_tokens=16))
