"""OpenAI-compatible HTTP API of a worker: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE
with `stream: true`), `GET /v1/models`. Errors use OpenAI's shape: 400 invalid_request_error (with
`param`), 429 with `Retry-After`, 503. A client that disconnects mid-stream aborts the request.

Probe paths of other serving stacks, so vLLM's and SGLang's routers can drive a kvmesh worker: `GET /health`
(vLLM) and `GET /model_info`, `/server_info`, `/get_model_info`, `/get_server_info` (SGLang) answer 200 with
a minimal JSON `{"model_path", "tokenizer_path", "is_generation"}`. (`/healthz` is the server bootstrap's.)"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from kvmesh.engine.base import Engine, EngineOutput, EngineRequest, SamplingParams, Usage
from kvmesh.errors import InvalidArgument, KvmeshError, ResourceExhausted, Unavailable
from kvmesh.services.worker import metrics as m

FINISH = {"prefill_only": "length"}
PROBE_PATHS = ("/health", "/model_info", "/server_info", "/get_model_info", "/get_server_info")


def render_chat(messages: Any) -> str:
    """The tiny model's chat template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "a non-empty list of {role, content} is required")
    parts = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidArgument(f"messages[{i}]", "needs a string role")
        content = msg.get("content", "")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")
        parts.append(f"<|{msg['role']}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def _num(body: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
        raise InvalidArgument(key, "must be an integer")
    if kind is float and (not isinstance(v, int | float) or isinstance(v, bool)):
        raise InvalidArgument(key, "must be a number")
    return kind(v)


def sampling_from_body(body: dict[str, Any], chat: bool) -> SamplingParams:
    if _num(body, "n", 1, int) != 1:
        raise InvalidArgument("n", "only n=1 is supported")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    return SamplingParams(
        max_tokens=_num(body, max_key, None if chat else 16, int),
        min_tokens=_num(body, "min_tokens", 0, int),
        temperature=_num(body, "temperature", 1.0, float),
        top_p=_num(body, "top_p", 1.0, float),
        top_k=_num(body, "top_k", 0, int),
        seed=_num(body, "seed", None, int),
        stop=stops,
        stop_token_ids=tuple(body.get("stop_token_ids") or ()),
        ignore_eos=bool(body.get("ignore_eos", False)),
        presence_penalty=_num(body, "presence_penalty", 0.0, float),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, float),
    )


def prompt_of(body: dict[str, Any]) -> tuple[tuple[int, ...] | None, str | None]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str):
        return None, p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return tuple(p), None
    raise InvalidArgument("prompt", "a string, a list of token ids, or a one-element list of either")


def usage_json(u: Usage | None) -> dict[str, Any]:
    if u is None:
        return {}
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def error_response(e: Exception) -> web.Response:
    if isinstance(e, InvalidArgument):
        return web.json_response(
            {"error": {"message": e.message, "type": "invalid_request_error", "param": e.field, "code": None}},
            status=400,
        )
    if isinstance(e, ResourceExhausted):
        return web.json_response(
            {"error": {"message": e.message, "type": "rate_limit_exceeded", "param": None, "code": None}},
            status=429,
            headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))},
        )
    msg = e.message if isinstance(e, KvmeshError) else "internal error"
    status = 503 if isinstance(e, Unavailable) else 500
    return web.json_response(
        {"error": {"message": msg, "type": "server_error", "param": None, "code": None}}, status=status
    )


class OpenAIApi:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
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
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise InvalidArgument("body", "must be a JSON object")
            ids, text = (None, render_chat(body.get("messages"))) if chat else prompt_of(body)
            sampling = sampling_from_body(body, chat)
        except json.JSONDecodeError:
            return error_response(InvalidArgument("body", "not valid JSON"))
        except InvalidArgument as e:
            return error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        req = EngineRequest(rid, prompt_token_ids=ids, prompt=text, sampling=sampling)
        stream = self.engine.generate(req)
        timer = m.StreamTimer(time.monotonic())
        try:
            first = await anext(stream)  # errors before the first token become HTTP errors
        except StopAsyncIteration:
            return error_response(Unavailable("engine ended the stream"))
        except (KvmeshError, ValueError) as e:
            await stream.aclose()
            return error_response(e)
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._sse(request, rid, chat, first, stream, timer, include_usage)
            return await self._whole(rid, chat, first, stream, timer)
        finally:
            await stream.aclose()

    def _observe(self, out: EngineOutput, timer: m.StreamTimer) -> None:
        timer.tokens(time.monotonic(), len(out.token_ids))
        if out.finished:
            m.observe_finished(out.usage, out.finish_reason)

    async def _whole(
        self,
        rid: str,
        chat: bool,
        first: EngineOutput,
        stream: AsyncGenerator[EngineOutput, None],
        timer: m.StreamTimer,
    ) -> web.Response:
        text, last = [first.text], first
        self._observe(first, timer)
        while not last.finished:
            last = await anext(stream)
            self._observe(last, timer)
            text.append(last.text)
        reason = FINISH.get(last.finish_reason or "", last.finish_reason)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": usage_json(last.usage),
            }
        )

    async def _sse(
        self,
        request: web.Request,
        rid: str,
        chat: bool,
        first: EngineOutput,
        stream: AsyncGenerator[EngineOutput, None],
        timer: m.StreamTimer,
        include_usage: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        def chunk(out: EngineOutput, first_chunk: bool) -> dict[str, Any]:
            reason = FINISH.get(out.finish_reason or "", out.finish_reason) if out.finished else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if chat:
                choice["delta"] = ({"role": "assistant"} if first_chunk else {}) | {"content": out.text}
            else:
                choice["text"] = out.text
            return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}

        out, is_first = first, True
        while True:
            self._observe(out, timer)
            await send(chunk(out, is_first))
            is_first = False
            if out.finished:
                break
            out = await anext(stream)
        if include_usage:
            await send(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": usage_json(out.usage),
                }
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
