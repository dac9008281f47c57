"""The HTTP API's answer from the router's chunks: one OpenAI choice per sequence of each prompt.

A completions batch is one `RouterRequest` per prompt (each routed on its own prefix, admitted on its own),
run concurrently (`prompt_chunks`); a chunk of sequence `s` of prompt `p` is choice `p * n + s`. Each choice
collects its text, finish reason and log-probabilities (`Choices`); usage is the sum of every prompt's. With
`echo` a completions choice starts with its prompt's text and, when log-probabilities are asked for, the
prompt's (the worker's `prompt_logprobs`, sent once per prompt on its first step, as vLLM's server does).
Streamed, each choice's first chunk carries the echo; non-streamed, the choice's whole text does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.openai.responses import (
    Choice,
    CompletionLogprobs,
    Decode,
    ResponseBuilder,
    chat_logprobs,
    merge_completion_logprobs,
    prompt_logprobs_json,
)
from kvmesh.services.router.chunks import Chunk, Logprobs
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.sequences import merge_streams
from kvmesh.v1 import common_pb2

FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
    common_pb2.FINISH_REASON_CONTENT_FILTER: "content_filter",
}


def finish_of(c: Chunk) -> str | None:
    """OpenAI's finish_reason of a chunk (None while its sequence goes on)."""
    return FINISH.get(c.finish_reason) if c.finish_reason else None


@dataclass(frozen=True, slots=True)
class PromptRun:
    """One prompt of the answer: its request and, with `echo`, its text and token ids (else '' and ())."""

    req: RouterRequest
    echo_text: str = ""
    echo_ids: tuple[int, ...] = ()


def prompt_chunks(
    generate: Callable[[RouterRequest], AsyncGenerator[Chunk, None]], runs: Sequence[PromptRun]
) -> AsyncGenerator[tuple[int, Chunk], None]:
    """Every prompt's chunks with its prompt index, the prompts run concurrently (one: as it is)."""
    if len(runs) == 1:
        return _one(generate(runs[0].req))
    return merge_streams({i: generate(r.req) for i, r in enumerate(runs)})


async def _one(chunks: AsyncGenerator[Chunk, None]) -> AsyncGenerator[tuple[int, Chunk], None]:
    try:
        async for c in chunks:
            yield 0, c
    finally:
        await chunks.aclose()  # cancels the worker call, frees the admission slot


@dataclass(slots=True)
class _Choice:
    """A choice as its chunks come."""

    texts: list[str] = field(default_factory=list)
    finish: str | None = None
    chat_entries: list[Any] = field(default_factory=list)
    completion_parts: list[dict[str, Any]] = field(default_factory=list)
    completion: CompletionLogprobs | None = None
    started: bool = False


class Choices:
    """The choices of one answer (`n` per prompt) and its usage, for a stream (`step`) or a whole answer
    (`add`, then `whole`)."""

    def __init__(
        self, build: ResponseBuilder, runs: Sequence[PromptRun], n: int, logprobs: bool, decode: Decode
    ) -> None:
        self.build, self.runs, self.n, self.logprobs, self.decode = build, runs, n, logprobs, decode
        self._choices: dict[int, _Choice] = {}
        self._prompt_logprobs: dict[int, Logprobs] = {}
        self._usage: dict[int, common_pb2.Usage] = {}

    def step(self, prompt: int, c: Chunk) -> dict[str, Any] | None:
        """The SSE chunk of a streamed chunk (None when it carries nothing for the client)."""
        index, ch = self._take(prompt, c)
        text, lp = self._delta(prompt, c, ch)
        first, ch.started = not ch.started, True
        if not (text or lp or c.finish_reason or first):
            return None
        return self.build.chunk(text, finish_of(c), first, index, lp)

    def add(self, prompt: int, c: Chunk) -> None:
        """A chunk of a whole answer."""
        _, ch = self._take(prompt, c)
        text, lp = self._delta(prompt, c, ch)
        ch.started = True
        ch.texts.append(text)
        if lp is not None:
            if self.build.chat:
                ch.chat_entries.extend(lp["content"])
            else:
                ch.completion_parts.append(lp)
        ch.finish = finish_of(c) or ch.finish

    def whole(self) -> dict[str, Any]:
        """The non-streamed answer: every choice (one whose stream ended without a finish reason: `stop`; no
        chunk at all: one `error` choice), with vLLM's `prompt_logprobs` when asked for (a completions
        choice: its prompt's; a chat answer: at the top)."""
        out = []
        for i, ch in self._choices.items():
            lp: dict[str, Any] | None = None
            if self.logprobs:
                chat = {"content": ch.chat_entries}
                lp = chat if self.build.chat else merge_completion_logprobs(ch.completion_parts)
            plp = None if self.build.chat else self._prompt_logprobs_json(i // self.n)
            out.append(Choice(i, "".join(ch.texts), ch.finish or "stop", lp, plp))
        top = self._prompt_logprobs_json(0) if self.build.chat else None
        return self.build.whole_choices(out or [Choice(0, "", "error")], self.usage, top)

    def _prompt_logprobs_json(self, prompt: int) -> list[dict[str, Any] | None] | None:
        """Prompt `prompt`'s `prompt_logprobs` in vLLM's shape; None when the request did not ask for them."""
        if self.runs[prompt].req.sampling.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(self._prompt_logprobs.get(prompt, ()), self.decode)

    @property
    def usage(self) -> common_pb2.Usage | None:
        """Every prompt's usage summed (None before any)."""
        if not self._usage:
            return None
        total = common_pb2.Usage()
        for u in self._usage.values():
            total.prompt_tokens += u.prompt_tokens
            total.completion_tokens += u.completion_tokens
            total.cached_tokens += u.cached_tokens
        return total

    def _take(self, prompt: int, c: Chunk) -> tuple[int, _Choice]:
        """The chunk's choice; notes its prompt's log-probabilities and usage."""
        if c.prompt_logprobs:  # the first attempt's: a migrated one's cover the prompt and the tokens so far
            self._prompt_logprobs.setdefault(prompt, c.prompt_logprobs)
        if c.usage is not None:
            self._usage[prompt] = c.usage
        index = prompt * self.n + c.index
        return index, self._choices.setdefault(index, _Choice())

    def _delta(self, prompt: int, c: Chunk, ch: _Choice) -> tuple[str, dict[str, Any] | None]:
        """The chunk's text and logprobs object, the echoed prompt before a choice's first."""
        run = self.runs[prompt]
        echo = not ch.started and bool(run.echo_text or run.echo_ids)
        text = (run.echo_text if echo else "") + c.text
        if not self.logprobs:
            return text, None
        if self.build.chat:
            return text, chat_logprobs(c.logprobs, self.decode)
        if ch.completion is None:
            ch.completion = CompletionLogprobs(self.decode)
        ids, entries = list(c.token_ids), list(c.logprobs)
        if echo:
            prompt_entries = self._prompt_logprobs.get(prompt, ())
            padded = [*prompt_entries, *[None] * (len(run.echo_ids) - len(prompt_entries))]
            ids, entries = [*run.echo_ids, *ids], [*padded[: len(run.echo_ids)], *entries]
        return text, ch.completion.add(ids, entries)
