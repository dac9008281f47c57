"""OpenAI-compatible HTTP API and admin endpoints, on the service's aiohttp app.

    GET  /v1/models
    POST /v1/completions          {"prompt": str | [int], "max_tokens", "temperature", "top_p", "stream", ...}
    POST /v1/chat/completions     {"messages": [{"role", "content"}], ...}   (SSE when "stream": true)
    POST /admin/rebalance         {"prefill_weight": 0.7, "decode_weight": 0.3}
    GET  /admin/workers
    POST /admin/drain             {"worker_id": "...", "drain": true}

Auth: `Authorization: Bearer <key>`; affinity: `X-Session-Id` (or `"user"`/`"session_id"` in the body).
Errors are `{"error": {"message", "type", "param", "code"}}` with 400 / 401 / 404 / 413 / 429 (+ Retry-After)
/ 503; an error after an SSE stream started is sent as a final `data: {"error": ...}` event.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from kvmesh.errors import (
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvmesh.services.router import metrics as m
from kvmesh.services.router.core import Chunk, GenRequest
from kvmesh.services.router.frontend import Frontend
from kvmesh.v1 import common_pb2

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def error_response(exc: BaseException) -> web.Response:
    """Domain error → OpenAI-style JSON error with the matching HTTP status."""
    status, etype, headers = 500, "internal_error", {}
    param = None
    if isinstance(exc, InvalidArgument):
        status, etype, param = 400, "invalid_request_error", exc.field
    elif isinstance(exc, Unauthenticated):
        status, etype = 401, "authentication_error"
    elif isinstance(exc, NotFound):
        status, etype = 404, "not_found_error"
    elif isinstance(exc, ResourceExhausted):
        status, etype = 429, "rate_limit_error"
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    elif isinstance(exc, Unavailable):
        status, etype = 503, "service_unavailable"
    msg = exc.message if isinstance(exc, KvmeshError) else "internal error"
    body = {"error": {"message": msg, "type": etype, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= v <= hi) or not math.isfinite(v):
        raise InvalidArgument(key, f"must be a number in [{lo}, {hi}]")
    return float(v)


class HttpApi:
    """Handlers bound to one `Frontend`."""

    def __init__(self, front: Frontend, max_request_bytes: int) -> None:
        self.front = front
        self.max_request_bytes = max_request_bytes

    def install(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._wrap(self.models))
        app.router.add_post("/v1/completions", self._wrap(self.completions))
        app.router.add_post("/v1/chat/completions", self._wrap(self.chat))
        app.router.add_post("/admin/rebalance", self._wrap(self.rebalance))
        app.router.add_get("/admin/workers", self._wrap(self.workers))
        app.router.add_post("/admin/drain", self._wrap(self.drain))

    def _wrap(
        self, fn: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                return await fn(request)
            except KvmeshError as e:
                return error_response(e)

        return handler

    # ---- helpers -----------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> None:
        h = request.headers.get("Authorization", "")
        key = h[7:].strip() if h.lower().startswith("bearer ") else request.headers.get("X-Api-Key")
        self.front.authorize(key)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            raise InvalidArgument("body", f"request body larger than {self.max_request_bytes} bytes")
        try:
            raw = await request.read()  # the whole body (bounded by the app's client_max_size)
        except web.HTTPRequestEntityTooLarge:
            raise InvalidArgument("body", f"request body larger than {self.max_request_bytes} bytes") from None
        if len(raw) > self.max_request_bytes:
            raise InvalidArgument("body", f"request body larger than {self.max_request_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidArgument("body", f"malformed JSON: {e}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("body", "must be a JSON object")
        return body

    def _sampling(self, body: dict[str, Any]) -> common_pb2.SamplingParams:
        sp = common_pb2.SamplingParams(
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0),
            max_tokens=int(_num(body, "max_tokens", 0, 1, self.front.core.limits.max_tokens_limit))
            if body.get("max_tokens") is not None
            else 0,
        )
        if body.get("seed") is not None:
            sp.seed = int(_num(body, "seed", 0, 0, 2**63))
        stop = body.get("stop")
        if isinstance(stop, str):
            sp.stop.append(stop)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            sp.stop.extend(stop)
        elif stop is not None:
            raise InvalidArgument("stop", "must be a string or a list of strings")
        if body.get("ignore_eos") is True:
            sp.ignore_eos = True
        return sp

    def _lora(self, body: dict[str, Any]) -> str:
        """The adapter the body's "model" selects (checked before the prompt is tokenised)."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidArgument("model", "must be a string")
        return self.front.lora_for(model or "", "")

    def _gen_request(self, request: web.Request, body: dict[str, Any], ids: list[int], lora: str) -> GenRequest:
        session = request.headers.get("X-Session-Id") or str(body.get("session_id") or body.get("user") or "")
        return GenRequest(
            f"http-{uuid.uuid4().hex}",
            common_pb2.TokenIds(ids=ids),
            self._sampling(body),
            session_id=session,
            lora=lora,
        )

    # ---- OpenAI ------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        base = self.front.model_name
        data = [{"id": base, "object": "model", "owned_by": "kvmesh"}]
        data += [{"id": a, "object": "model", "owned_by": "kvmesh", "parent": base} for a in self.front.lora_adapters]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        body = await self._json(request)
        lora = self._lora(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            ids = await self.front.tokenize_text(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise InvalidArgument("prompt", "must be a non-empty string or list of token ids")
        return await self._respond(request, body, self._gen_request(request, body, ids, lora), chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        body = await self._json(request)
        lora = self._lora(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not all(
            isinstance(x, dict) and isinstance(x.get("role"), str) and isinstance(x.get("content"), str) for x in msgs
        ):
            raise InvalidArgument("messages", "must be a list of {role, content} objects with string values")
        ids = await self.front.tokenize_chat([(x["role"], x["content"]) for x in msgs])
        return await self._respond(request, body, self._gen_request(request, body, ids, lora), chat=True)

    async def _respond(
        self, request: web.Request, body: dict[str, Any], req: GenRequest, chat: bool
    ) -> web.StreamResponse:
        api = "chat" if chat else "completions"
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        model = req.lora or self.front.model_name
        self.front.core.check(req)
        if not body.get("stream"):
            texts: list[str] = []
            last: Chunk | None = None
            try:
                async for c in self.front.core.generate(req):
                    texts.append(c.text)
                    last = c
            except KvmeshError:
                m.REQUESTS.labels(api, "error").inc()
                raise
            m.REQUESTS.labels(api, "ok").inc()
            text = "".join(texts)
            finish = _FINISH.get(last.finish_reason, "stop") if last else "error"
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            usage = _usage(last.usage if last else None)
            return web.json_response(
                {
                    "id": req.request_id,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        # SSE: the first chunk is awaited before the headers go out, so early errors get a real status code
        gen = self.front.core.generate(req)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except KvmeshError:
            m.REQUESTS.labels(api, "error").inc()
            raise
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj_chunk = "chat.completion.chunk" if chat else "text_completion"
        outcome = "ok"

        async def send(c: Chunk) -> None:
            fin = _FINISH.get(c.finish_reason) if c.finish_reason else None
            ch: dict[str, Any] = {"index": 0, "finish_reason": fin}
            if chat:
                ch["delta"] = {"content": c.text}
            else:
                ch["text"] = c.text
            ev: dict[str, Any] = {
                "id": req.request_id,
                "object": obj_chunk,
                "created": created,
                "model": model,
                "choices": [ch],
            }
            if c.usage is not None:
                ev["usage"] = _usage(c.usage)
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")

        try:
            if first is not None:
                await send(first)
                async for c in gen:
                    await send(c)
        except KvmeshError as e:
            outcome = "error"
            err = {"error": {"message": e.message, "type": type(e).__name__}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        finally:
            await gen.aclose()
            m.REQUESTS.labels(api, outcome).inc()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- admin -------------------------------------------------------------------------------------
    async def rebalance(self, request: web.Request) -> web.StreamResponse:
        self.front.keys.check(_bearer(request))
        body = await self._json(request)
        pw = _num(body, "prefill_weight", -1, 0.0, 1e9)
        dw = _num(body, "decode_weight", -1, 0.0, 1e9)
        p, d = self.front.rebalance(pw, dw)
        return web.json_response({"prefill_weight": p, "decode_weight": d})

    async def workers(self, request: web.Request) -> web.StreamResponse:
        self.front.keys.check(_bearer(request))
        return web.json_response(MessageToDict(self.front.list_workers(), preserving_proto_field_name=True))

    async def drain(self, request: web.Request) -> web.StreamResponse:
        self.front.keys.check(_bearer(request))
        body = await self._json(request)
        wid = body.get("worker_id")
        if not isinstance(wid, str) or not wid:
            raise InvalidArgument("worker_id", "must be a non-empty string")
        n = self.front.drain(wid, bool(body.get("drain", True)))
        return web.json_response({"in_flight": n})


def _bearer(request: web.Request) -> str | None:
    h = request.headers.get("Authorization", "")
    return h[7:].strip() if h.lower().startswith("bearer ") else request.headers.get("X-Api-Key")


def _usage(u: common_pb2.Usage | None) -> dict[str, Any]:
    if u is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
