"""OpenAI response objects (pure): whole completions, stream chunks, usage, log-probabilities and SSE framing.

A response has one choice per sequence (`index`: with `n > 1`, and in a completions batch `prompt_index * n
+ sequence index`). Log-probabilities come in OpenAI's two shapes, as vLLM's server writes them: chat
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`
(`chat_logprobs`), completions `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}` (`CompletionLogprobs`: a completions entry's top list holds the sampled token too, and a
prompt's first position, echoed, has none: null). vLLM's `prompt_logprobs` (`prompt_logprobs_json`) are
a list per prompt position: null for the first (nothing precedes it), then {token id (a string key):
{"logprob", "rank", "decoded_token"}}; a completions choice carries its prompt's, a chat answer its one
prompt's at the top level, as vLLM's server places them. Token strings are the caller's (`Decode`: the
model's tokenizer on one id); a log-probability of -inf is written as -9999.0, as vLLM and OpenAI do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.core.generation import PositionLogprobs, TokenLogprob

Decode = Callable[[int], str]  # one token id → its text
LOGPROB_FLOOR = -9999.0

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


def _logprob(x: TokenLogprob) -> float:
    return max(x.logprob, LOGPROB_FLOOR)


def _chat_token(x: TokenLogprob, decode: Decode) -> dict[str, Any]:
    token = decode(x.token_id)
    return {"token": token, "logprob": _logprob(x), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Sequence[PositionLogprobs | None], decode: Decode) -> dict[str, Any]:
    """A chat choice's (or delta's) `logprobs`: one entry per generated token, its top alternatives."""
    content = []
    for e in entries:
        if e is None:
            continue  # only a prompt's first position has none, and chat never echoes its prompt
        content.append(_chat_token(e.token, decode) | {"top_logprobs": [_chat_token(x, decode) for x in e.top]})
    return {"content": content}


def prompt_logprobs_json(entries: Sequence[PositionLogprobs | None], decode: Decode) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per position null (the first) or the prompt's own token first, then the top
    alternatives by rank, each `{"logprob", "rank", "decoded_token"}` keyed by its id (a token among the top
    ones once, where vLLM's dict keeps it: first)."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position: dict[str, Any] = {}
        for x in (e.token, *e.top):
            key = str(x.token_id)
            if key not in position:
                position[key] = {"logprob": _logprob(x), "rank": x.rank, "decoded_token": decode(x.token_id)}
        out.append(position)
    return out


class CompletionLogprobs:
    """One completions choice's `logprobs` as its tokens come (`text_offset` runs on across a stream's
    chunks, from the echoed prompt's first character)."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.offset = 0

    def add(self, token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None]) -> dict[str, Any]:
        """The object for `token_ids` (and their entries, one each; an echoed prompt's first is None)."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, e in zip(token_ids, entries, strict=False):
            token = self.decode(token_id)
            out["tokens"].append(token)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_logprob(e.token))
            top = {self.decode(x.token_id): _logprob(x) for x in (e.token, *e.top)}
            out["top_logprobs"].append(top)
        return out


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Several `CompletionLogprobs.add` objects of one choice as one (None when there are none)."""
    if not parts:
        return None
    return {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


@dataclass(slots=True)
class Choice:
    """One whole choice: its index, text, finish reason, `logprobs` object and, for a completion, its
    prompt's `prompt_logprobs` (`prompt_logprobs_json`; None: not asked for, and no key)."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ResponseBuilder:
    """The objects of one response: `id`, `object`, `created` and `model` are the same on each."""

    def __init__(self, request_id: str, chat: bool, created: int, model: str) -> None:
        self.chat = chat
        self._head = {"id": request_id, "created": created, "model": model}

    def whole(self, text: str, finish_reason: str | None, usage: UsageLike | None) -> dict[str, Any]:
        """The non-streamed answer of one choice."""
        return self.whole_choices([Choice(0, text, finish_reason)], usage)

    def whole_choices(
        self,
        choices: Sequence[Choice],
        usage: UsageLike | None,
        prompt_logprobs: list[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """The non-streamed answer, its choices in index order; `prompt_logprobs`: a chat answer's (its key
        only when asked for; a completion's are its choices')."""
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
                if c.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = c.prompt_logprobs
            out.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        whole = {**self._head, "object": obj, "choices": out, "usage": usage_json(usage)}
        if self.chat and prompt_logprobs is not None:
            whole["prompt_logprobs"] = prompt_logprobs
        return whole

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk of choice `index`; a chat choice's first delta carries the assistant role (usage:
        `usage_chunk`)."""
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
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
