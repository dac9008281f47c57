"""OpenAI response objects (pure): whole completions, stream chunks, usage, and SSE framing."""

from __future__ import annotations

import json
from typing import Any, Protocol

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"


class UsageLike(Protocol):
    """Token counts, as `kvmesh.engine.base.Usage` and `common_pb2.Usage` both carry them."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE `data:` event."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def usage_json(u: UsageLike | None) -> dict[str, Any]:
    """OpenAI's usage object (zeros when unknown)."""
    if u is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class ResponseBuilder:
    """The objects of one response: `id`, `object`, `created` and `model` are the same on each."""

    def __init__(self, request_id: str, chat: bool, created: int, model: str) -> None:
        self.chat = chat
        self._head = {"id": request_id, "created": created, "model": model}

    def whole(self, text: str, finish_reason: str | None, usage: UsageLike | None) -> dict[str, Any]:
        """The non-streamed answer."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head, "object": obj, "choices": [choice], "usage": usage_json(usage)}

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """A stream chunk; a chat's first delta carries the assistant role (usage: `usage_chunk`)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | {"content": text}
        else:
            choice["text"] = text
        return {**self._head, "object": self._chunk_object, "choices": [choice]}

    def usage_chunk(self, usage: UsageLike | None) -> dict[str, Any]:
        """The final chunk of `stream_options.include_usage`: no choices, the usage."""
        return {**self._head, "object": self._chunk_object, "choices": [], "usage": usage_json(usage)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"
