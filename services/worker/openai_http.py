"""OpenAI-compatible HTTP API of a worker: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE
with `stream: true`), `GET /v1/models`. Parsing, bounds, response objects and errors are `kvmesh.openai`'s
(shared with the router; the same status and error type for the same error). A client that disconnects
mid-stream aborts the request.

Probe paths of other serving stacks, so vLLM's and SGLang's routers can drive a kvmesh worker: `GET /health`
(vLLM) and `GET /model_info`, `/server_info`, `/get_model_info`, `/get_server_info` (SGLang) answer 200 with
a minimal JSON `{"model_path", "tokenizer_path", "is_generation"}`. (`/healthz` is the server bootstrap's.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from aiohttp import web

from kvmesh.core.errors import InvalidArgument, KvmeshError, Unavailable
from kvmesh.core.generation import EngineOutput, EngineRequest, PositionLogprobs
from kvmesh.engine.base import Engine
from kvmesh.openai.aio import ClientGone, SseWriter, client_gone, error_response, openai_errors, read_json
from kvmesh.openai.protocol import Message, OpenAIRequest, parse_request, require_plain_chat
from kvmesh.openai.responses import Choice, CompletionLogprobs, Decode, ResponseBuilder, chat_logprobs
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.admission import WindowGate

FINISH = {"prefill_only": "length"}
PROBE_PATHS = ("/health", "/model_info", "/server_info", "/get_model_info", "/get_server_info")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; a chat's runs to the limit


def render_chat(messages: Sequence[Message]) -> str:
    """The tiny model's chat template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def _finish(out: EngineOutput) -> str | None:
    return FINISH.get(out.finish_reason or "", out.finish_reason) if out.finished else None


def refuse_unserved(parsed: OpenAIRequest) -> None:
    """What only the router's HTTP API serves (a batch of prompts, echo, tools, prompt log-probabilities) is
    refused here, never silently dropped."""
    if len(parsed.prompts) > 1:
        raise InvalidArgument("prompt", "a worker serves one prompt per request: send batches to the router")
    if parsed.echo:
        raise InvalidArgument("echo", "not served by a worker's HTTP API: use the router's")
    if parsed.tools:
        raise InvalidArgument("tools", "not served by a worker's HTTP API: use the router's")
    if parsed.sampling.prompt_logprobs is not None:
        raise InvalidArgument("prompt_logprobs", "not served by a worker's HTTP API: use the router's")


class _Choices:
    """Each sequence's text, finish reason and log-probabilities as its outputs come (`index`: its choice)."""

    def __init__(self, chat: bool, decode: Decode, logprobs: bool) -> None:
        self.chat, self.decode, self.logprobs = chat, decode, logprobs
        self.text: dict[int, list[str]] = {}
        self.finish: dict[int, str | None] = {}
        self.entries: dict[int, list[PositionLogprobs]] = {}
        self.ids: dict[int, list[int]] = {}
        self.completion_lps: dict[int, CompletionLogprobs] = {}  # streamed completions: offsets run on

    def add(self, out: EngineOutput) -> None:
        """Collect `out` for the whole answer."""
        self.text.setdefault(out.index, []).append(out.text)
        self.finish[out.index] = _finish(out)
        self.entries.setdefault(out.index, []).extend(out.logprobs)
        self.ids.setdefault(out.index, []).extend(out.token_ids)

    def delta_logprobs(self, out: EngineOutput) -> dict[str, Any] | None:
        """The `logprobs` object of `out`'s stream chunk (None when not asked for)."""
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(out.logprobs, self.decode)
        lp = self.completion_lps.setdefault(out.index, CompletionLogprobs(self.decode))
        return lp.add(out.token_ids, out.logprobs)

    def whole(self) -> list[Choice]:
        """Every choice of the whole answer."""
        out = []
        for index in sorted(self.text):
            lps: dict[str, Any] | None = None
            if self.logprobs and self.chat:
                lps = chat_logprobs(self.entries[index], self.decode)
            elif self.logprobs:
                lps = CompletionLogprobs(self.decode).add(self.ids[index], self.entries[index])
            out.append(Choice(index, "".join(self.text[index]), self.finish[index], lps))
        return out


class OpenAIApi:
    def __init__(self, engine: Engine, model_name: str, gate: WindowGate | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.gate = gate  # the batching window (None: off)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", openai_errors(self.completions))
        app.router.add_post("/v1/chat/completions", openai_errors(self.chat_completions))
        app.router.add_get("/v1/models", self.models)
        for path in PROBE_PATHS:
            app.router.add_get(path, self.probe)

    async def probe(self, _request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_name, "tokenizer_path": None, "is_generation": True})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvmesh"}]}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await read_json(request)
        default = None if chat else COMPLETION_DEFAULT_MAX_TOKENS
        parsed = parse_request(body, chat, max_tokens_limit=None, default_max_tokens=default)  # engine: the limit
        refuse_unserved(parsed)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if chat:
            require_plain_chat(parsed)
        text = render_chat(parsed.messages) if chat else parsed.prompt_text
        req = EngineRequest(rid, prompt_token_ids=parsed.prompt_ids, prompt=text, sampling=parsed.sampling)
        if self.gate is not None:
            try:
                await self.gate.admit(req)
            except KvmeshError as e:
                return error_response(e)
        stream = self.engine.generate(req)
        timer = m.StreamTimer(time.monotonic())
        try:
            first = await anext(stream)  # errors before the first token become HTTP errors
        except StopAsyncIteration:
            return error_response(Unavailable("engine ended the stream"))
        except (KvmeshError, ValueError) as e:
            await stream.aclose()
            return error_response(e)
        build = ResponseBuilder(rid, chat, int(time.time()), self.model_name)
        choices = _Choices(chat, self.engine.decode_token, parsed.sampling.logprobs is not None)
        sse = SseWriter()
        try:
            if parsed.stream:
                return await self._sse(request, sse, build, parsed, first, stream, timer, choices)
            return await self._whole(build, first, stream, timer, choices)
        except ClientGone as e:
            return client_gone(request, sse.response, e)
        finally:
            await stream.aclose()  # aborts the request in the engine when the client went away

    def _observe(self, out: EngineOutput, timer: m.StreamTimer) -> None:
        timer.tokens(time.monotonic(), len(out.token_ids))
        if out.finished:
            m.observe_finished(out.usage, out.finish_reason)

    async def _whole(
        self,
        build: ResponseBuilder,
        first: EngineOutput,
        stream: AsyncGenerator[EngineOutput, None],
        timer: m.StreamTimer,
        choices: _Choices,
    ) -> web.Response:
        last = first
        self._observe(first, timer)
        choices.add(first)
        async for last in stream:  # the stream ends once every sequence has finished
            self._observe(last, timer)
            choices.add(last)
        return web.json_response(build.whole_choices(choices.whole(), last.usage))

    async def _sse(
        self,
        request: web.Request,
        sse: SseWriter,
        build: ResponseBuilder,
        parsed: OpenAIRequest,
        first: EngineOutput,
        stream: AsyncGenerator[EngineOutput, None],
        timer: m.StreamTimer,
        choices: _Choices,
    ) -> web.StreamResponse:
        await sse.start(request)
        started: set[int] = set()  # the choices whose first chunk went out (a chat's carries the role)
        out = first
        while True:
            self._observe(out, timer)
            lps = choices.delta_logprobs(out)
            await sse.send(build.chunk(out.text, _finish(out), out.index not in started, out.index, lps))
            started.add(out.index)
            nxt = await anext(stream, None)  # the stream ends once every sequence has finished
            if nxt is None:
                break
            out = nxt
        if parsed.include_usage:
            await sse.send(build.usage_chunk(out.usage))
        return await sse.finish()
