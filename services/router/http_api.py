"""OpenAI-compatible HTTP API and admin endpoints, on the service's aiohttp app.

    GET  /v1/models
    POST /v1/completions          {"prompt": str | [int], "max_tokens", "temperature", "top_p", "stream", ...}
    POST /v1/chat/completions     {"messages": [{"role", "content"}], ...}   (SSE when "stream": true)
    POST /admin/rebalance         {"prefill_weight": 0.7, "decode_weight": 0.3}
    GET  /admin/workers
    POST /admin/drain             {"worker_id": "...", "drain": true}

Auth: `Authorization: Bearer <key>`; affinity: `X-Session-Id` (or `"user"`/`"session_id"` in the body).
Parsing, bounds, response objects and errors are `kvmesh.openai`'s (shared with the worker): errors are
`{"error": {"message", "type", "param", "code"}}` from its one table (400 / 401 / 404 / 429 + Retry-After /
503 ...); an error after an SSE stream started is sent as a final `data: {"error": ...}` event. A body
that does not arrive within `body_timeout_s` is answered 408 and its connection closed; an SSE client that
disconnects is logged at INFO, its request cancelled on the worker and its admission slot freed.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.openai.aio import BODY_TIMEOUT_S, ClientGone, SseWriter, client_gone, openai_errors, read_json
from kvmesh.openai.protocol import OpenAIRequest, parse_model, parse_request
from kvmesh.openai.responses import ResponseBuilder
from kvmesh.services.router import metrics as m
from kvmesh.services.router.core import Chunk, RouterRequest
from kvmesh.services.router.frontend import Frontend
from kvmesh.v1 import common_pb2
from kvmesh.wire.proto import sampling_to_proto

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    """An admin body's number in [lo, hi]."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= v <= hi) or not math.isfinite(v):
        raise InvalidArgument(key, f"must be a number in [{lo}, {hi}]")
    return float(v)


class HttpApi:
    """Handlers bound to one `Frontend`."""

    def __init__(self, front: Frontend, max_request_bytes: int, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.front = front
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s

    def install(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", openai_errors(self.models))
        app.router.add_post("/v1/completions", openai_errors(self.completions))
        app.router.add_post("/v1/chat/completions", openai_errors(self.chat))
        app.router.add_post("/admin/rebalance", openai_errors(self.rebalance))
        app.router.add_get("/admin/workers", openai_errors(self.workers))
        app.router.add_post("/admin/drain", openai_errors(self.drain))

    # ---- helpers -----------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> None:
        self.front.authorize(_bearer(request))

    async def _json(self, request: web.Request) -> dict[str, Any]:
        return await read_json(request, self.max_request_bytes, self.body_timeout_s)

    async def _parse(self, request: web.Request, chat: bool) -> tuple[OpenAIRequest, str]:
        """Auth, body, the adapter "model" selects (checked before anything is tokenised), the request."""
        self._auth(request)
        body = await self._json(request)
        lora = self.front.lora_for(parse_model(body), "")
        limit = self.front.core.limits.max_tokens_limit
        parsed = parse_request(body, chat, max_tokens_limit=limit, default_max_tokens=None)
        self.front.check_token_ids(parsed.sampling.stop_token_ids, "stop_token_ids")
        return parsed, lora

    def _gen_request(self, request: web.Request, parsed: OpenAIRequest, ids: list[int], lora: str) -> RouterRequest:
        session = _header(request, "X-Session-Id") or parsed.user
        return RouterRequest(
            f"http-{uuid.uuid4().hex}",
            common_pb2.TokenIds(ids=ids),
            sampling_to_proto(parsed.sampling),
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
        parsed, lora = await self._parse(request, chat=False)
        if parsed.prompt_text is not None:
            ids = await self.front.tokenize_text(parsed.prompt_text)
        else:
            ids = list(parsed.prompt_ids or ())
            self.front.check_token_ids(ids, "prompt")  # before the wire's uint32 sees them
        return await self._respond(request, parsed, self._gen_request(request, parsed, ids, lora))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parsed, lora = await self._parse(request, chat=True)
        ids = await self.front.tokenize_chat(parsed.messages)
        return await self._respond(request, parsed, self._gen_request(request, parsed, ids, lora))

    async def _respond(self, request: web.Request, parsed: OpenAIRequest, req: RouterRequest) -> web.StreamResponse:
        api = "chat" if parsed.chat else "completions"
        build = ResponseBuilder(req.request_id, parsed.chat, int(time.time()), req.lora or self.front.model_name)
        self.front.core.check(req)
        if not parsed.stream:
            return await self._whole(api, build, req)
        # SSE: the first chunk is awaited before the headers go out, so early errors get a real status code
        gen = self.front.core.generate(req)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except KvmeshError:
            m.REQUESTS.labels(api, "error").inc()
            raise
        sse = SseWriter()
        outcome = "ok"
        try:
            await sse.start(request)
            if first is not None:
                await sse.send(build.chunk(first.text, _finish(first), first=True, usage=first.usage))
                async for c in gen:
                    await sse.send(build.chunk(c.text, _finish(c), first=False, usage=c.usage))
        except KvmeshError as e:
            outcome = "error"
            await self._fail(sse, e)
        except ClientGone as e:
            outcome = "cancelled"
            return client_gone(request, sse.response, e)
        finally:
            await gen.aclose()  # cancels the worker call, frees the admission slot
            m.REQUESTS.labels(api, outcome).inc()
        try:
            return await sse.finish()
        except ClientGone as e:
            return client_gone(request, sse.response, e)

    @staticmethod
    async def _fail(sse: SseWriter, exc: KvmeshError) -> None:
        """The error event; a client already gone does not get it (nothing to log but the error)."""
        with contextlib.suppress(ClientGone):
            await sse.fail(exc)

    async def _whole(self, api: str, build: ResponseBuilder, req: RouterRequest) -> web.StreamResponse:
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
        finish = (_finish(last) or "stop") if last else "error"
        return web.json_response(build.whole("".join(texts), finish, last.usage if last else None))

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


def _header(request: web.Request, name: str) -> str | None:
    """A request header as text; InvalidArgument naming it when its bytes are not UTF-8 (aiohttp passes those
    on as lone surrogates, which no encoder, hash or key comparison takes)."""
    value = request.headers.get(name)
    if value is not None:
        try:
            value.encode()
        except UnicodeEncodeError:
            raise InvalidArgument(name, "must be UTF-8 text") from None
    return value


def _bearer(request: web.Request) -> str | None:
    h = _header(request, "Authorization") or ""
    return h[7:].strip() if h.lower().startswith("bearer ") else _header(request, "X-Api-Key")


def _finish(c: Chunk) -> str | None:
    """OpenAI's finish_reason of a chunk (None while the stream goes on)."""
    return _FINISH.get(c.finish_reason) if c.finish_reason else None
