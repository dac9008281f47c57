"""OpenAI-compatible HTTP API and admin endpoints, on the service's aiohttp app.

    GET  /v1/models               (each with vLLM's `max_model_len`)
    GET  /health, GET|POST /ping  vLLM's probes: 200 and an empty body while serving, 503 draining; no credential
    POST /tokenize, /detokenize, GET /version   vLLM's extras (http_extras.py)
    POST /v1/completions          {"prompt": str | [int], "max_tokens", "temperature", "top_p", "stream", ...}
    POST /v1/chat/completions     {"messages": [{"role", "content"}], ...}   (SSE when "stream": true)
    POST /admin/rebalance         {"prefill_weight": 0.7, "decode_weight": 0.3}
    GET  /admin/workers
    POST /admin/drain             {"worker_id": "...", "drain": true}

Admin routes (`kvmesh.security.admin`): bodies only as `Content-Type: application/json` (else 415: a browser
form or text/plain POST, i.e. a CSRF, cannot reach them), typed fields (`"false"` is not a boolean: 400
naming the field), unknown fields 400 naming them; every admin request is one line of the audit log
(`kvmesh.rpc.audit`), refused ones included.

Auth: `Authorization: Bearer <key>` (or `X-Api-Key`), signed requests with `X-Kvmesh-Signature` and
`X-Kvmesh-Timestamp` (kvmesh.security.signing; the body is read before the signature is checked); tenant:
`X-Kvmesh-Tenant`, one the key may use (its first when absent; kvmesh.security.client_keys); affinity:
`X-Session-Id` (or `"user"`/`"session_id"` in the body).
Parsing, bounds, response objects and errors are `kvmesh.openai`'s (shared with the worker): errors are
`{"error": {"message", "type", "param", "code"}}` from its one table (400 / 401 / 404 / 429 + Retry-After /
503 ...); an error after an SSE stream started is sent as a final `data: {"error": ...}` event. A stream
carries `usage` only when `stream_options.include_usage` asks for it, in a last chunk with empty `choices`. A body
that does not arrive within `body_timeout_s` is answered 408 and its connection closed; an SSE client that
disconnects is logged at INFO, its request cancelled on the worker and its admission slot freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from kvmesh.core.errors import InvalidArgument, KvmeshError
from kvmesh.openai.aio import (
    BODY_TIMEOUT_S,
    ClientGone,
    SseWriter,
    client_gone,
    openai_errors,
    parse_json_object,
    read_body,
)
from kvmesh.openai.protocol import OpenAIRequest, parse_model, parse_request
from kvmesh.openai.responses import ResponseBuilder
from kvmesh.rpc.audit import audited
from kvmesh.rpc.server import probe
from kvmesh.security.admin import UnsupportedMediaType, require_json, typed_fields
from kvmesh.security.client_keys import bind_tenant
from kvmesh.security.identity import Identity
from kvmesh.security.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignedRequest
from kvmesh.services.router import metrics as m
from kvmesh.services.router.core import Chunk
from kvmesh.services.router.frontend import Frontend
from kvmesh.services.router.http_choices import Choices, PromptRun, prompt_chunks
from kvmesh.services.router.http_extras import HttpExtras, max_model_len
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.tokenize import ChatTemplateOptions
from kvmesh.services.router.tool_parsing import OutputParser, ParsedAnswer, ParsedChoices, parsed_answer
from kvmesh.wire.token_ids import TokenIdArray

TENANT_HEADER = "X-Kvmesh-Tenant"


SERVICE = "router"  # as the audit log names it
REBALANCE_BODY: dict[str, type] = {"prefill_weight": float, "decode_weight": float}
DRAIN_BODY: dict[str, type] = {"worker_id": str, "drain": bool, "force": bool}
MAX_WEIGHT = 1e9
AdminHandler = Callable[[web.Request, dict[str, object]], Awaitable[web.StreamResponse]]


def _weight(body: dict[str, Any], key: str) -> float:
    """A rebalance weight: required, in [0, MAX_WEIGHT]."""
    v = body.get(key)
    if v is None:
        raise InvalidArgument(key, "required")
    if not 0.0 <= v <= MAX_WEIGHT:
        raise InvalidArgument(key, f"must be a number in [0, {MAX_WEIGHT:g}], got {v}")
    return float(v)


def _unsupported(e: UnsupportedMediaType) -> web.Response:
    """415 in OpenAI's error shape."""
    err = {"message": e.message, "type": "invalid_request_error", "param": e.field, "code": 415}
    return web.json_response({"error": err}, status=415)


class HttpApi:
    """Handlers bound to one `Frontend`."""

    def __init__(
        self,
        front: Frontend,
        max_request_bytes: int,
        body_timeout_s: float = BODY_TIMEOUT_S,
        output_parser: OutputParser | None = None,
    ) -> None:
        self.front = front
        self.output_parser = output_parser  # --tool-call-parser / --reasoning-parser: read the answers
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s

    def install(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", openai_errors(self.models))
        app.router.add_post("/v1/completions", openai_errors(self.completions))
        app.router.add_post("/v1/chat/completions", openai_errors(self.chat))
        HttpExtras(self, TENANT_HEADER).install(app)  # vLLM's /tokenize, /detokenize, /version
        app.router.add_post("/admin/rebalance", self._admin(self.rebalance))
        app.router.add_get("/admin/workers", self._admin(self.workers))
        app.router.add_post("/admin/drain", self._admin(self.drain))
        for path in ("/health", "/ping"):  # vLLM's probe paths, without credentials (kvmesh.rpc.server.probe)
            app.router.add_get(path, probe)
        app.router.add_post("/ping", probe)

    # ---- helpers -----------------------------------------------------------------------------------
    async def _auth(self, request: web.Request, client: bool = True) -> tuple[Identity | None, bytes]:
        """The key (Unauthenticated before the body is read when it is unknown, or requires a signature that
        is absent), then, for an unsigned request, its rate-limit token (a client call) before the body is
        read, for a signed one the body (bounded) and the signature over it, then the token. Returns the
        identity (None: open router) and the body."""
        key = self.front.caller_key(_bearer(request))
        signed = SignedRequest(
            request.method,
            request.url.raw_path,
            b"",
            request.headers.get(SIGNATURE_HEADER),
            request.headers.get(TIMESTAMP_HEADER),
        )
        route = f"{request.method} {request.path}"
        check = self.front.authorize if client else lambda k, s: self.front.authenticate_admin(k, s, route)
        ident = None if signed.signed else check(key, signed)
        body = await read_body(request, self.max_request_bytes, self.body_timeout_s) if request.body_exists else b""
        if signed.signed:
            ident = check(key, dataclasses.replace(signed, body=body))
        return ident, body

    async def _admin_json(self, request: web.Request) -> dict[str, Any]:
        return parse_json_object((await self._auth(request, client=False))[1])

    async def _parse(self, request: web.Request, chat: bool) -> tuple[OpenAIRequest, str, str]:
        """Auth, body, the tenant, the adapter "model" selects (checked before anything is tokenised), the
        request; returns (request, lora, tenant)."""
        ident, raw = await self._auth(request)
        tenant = bind_tenant(ident, _header(request, TENANT_HEADER) or "")
        body = parse_json_object(raw)
        lora = self.front.lora_for(parse_model(body), "")
        limit = self.front.limits.max_tokens_limit
        return parse_request(body, chat, max_tokens_limit=limit, default_max_tokens=None), lora, tenant

    def _gen_request(
        self,
        request: web.Request,
        parsed: OpenAIRequest,
        prompt: TokenIdArray | Sequence[int],
        lora: str,
        tenant: str,
    ) -> RouterRequest:
        """The parsed request within the router's limits (a client's token ids are checked before they become
        uint32)."""
        session = _header(request, "X-Session-Id") or parsed.user
        rid = f"http-{uuid.uuid4().hex}"
        return RouterRequest.checked(
            self.front.limits, rid, prompt, parsed.sampling, session_id=session, tenant=tenant, lora=lora
        )

    # ---- OpenAI ------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.StreamResponse:
        await self._auth(request)
        base, ctx = self.front.model_name, max_model_len(self.front)  # vLLM's ModelCard carries max_model_len
        data = [{"id": base, "object": "model", "owned_by": "kvmesh", "max_model_len": ctx}]
        data += [
            {"id": a, "object": "model", "owned_by": "kvmesh", "parent": base, "max_model_len": ctx}
            for a in self.front.lora_adapters
        ]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed, lora, tenant = await self._parse(request, chat=False)
        prompts = parsed.prompts or ((parsed.prompt_ids, parsed.prompt_text),)  # a batch: each on its own prefix
        runs = [await self._prompt_run(request, parsed, ids, text, lora, tenant) for ids, text in prompts]
        return await self._respond(request, parsed, runs)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parsed, lora, tenant = await self._parse(request, chat=True)
        answer = parsed_answer(parsed, self.output_parser)  # "auto" without a tool parser: 400 before routing
        parsed = answer.parsed if answer is not None else parsed  # the sampling as the parser wants it
        prompt = await self.front.tokenize_chat(parsed.messages, tenant, ChatTemplateOptions.of(parsed))
        if answer is not None:
            answer.prompt_ids = prompt.array.tolist()
        return await self._respond(
            request, parsed, [PromptRun(self._gen_request(request, parsed, prompt, lora, tenant))], answer
        )

    async def _prompt_run(
        self,
        request: web.Request,
        parsed: OpenAIRequest,
        ids: Sequence[int] | None,
        text: str | None,
        lora: str,
        tenant: str,
    ) -> PromptRun:
        """One completions prompt's request and, with `echo`, its text and token ids."""
        prompt: TokenIdArray | Sequence[int] = ids or ()
        if text is not None:
            prompt = await self.front.tokenize_text(text, tenant)
        req = self._gen_request(request, parsed, prompt, lora, tenant)
        if not parsed.echo:
            return PromptRun(req)
        echo_ids = tuple(int(i) for i in (prompt.array if isinstance(prompt, TokenIdArray) else prompt))
        return PromptRun(req, text if text is not None else self.front.tokenizer.decode(echo_ids), echo_ids)

    def _decode(self, token_id: int) -> str:
        """One token's text, as log-probabilities name it."""
        return self.front.tokenizer.decode([token_id])

    async def _respond(
        self, request: web.Request, parsed: OpenAIRequest, runs: list[PromptRun], answer: ParsedAnswer | None = None
    ) -> web.StreamResponse:
        api = "chat" if parsed.chat else "completions"
        req = runs[0].req
        build = ResponseBuilder(req.request_id, parsed.chat, int(time.time()), req.lora or self.front.model_name)
        want_logprobs = parsed.sampling.logprobs is not None
        args = (build, runs, parsed.sampling.n, want_logprobs, self._decode)
        choices = Choices(*args) if answer is None else ParsedChoices(answer, *args)
        gen = prompt_chunks(self.front.generate, runs)
        if not parsed.stream:
            return await self._whole(api, choices, gen)
        # SSE: the first chunk is awaited before the headers go out, so early errors get a real status code
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except KvmeshError:
            await gen.aclose()
            m.REQUESTS.labels(api, "error").inc()
            raise
        sse = SseWriter()
        outcome = "ok"
        try:
            await sse.start(request)
            if first is not None:
                await self._send(sse, choices.step(*first))
                async for p, c in gen:
                    await self._send(sse, choices.step(p, c))
            if parsed.include_usage:  # OpenAI's and vLLM's place: a last chunk, empty choices
                await sse.send(build.usage_chunk(choices.usage))
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
    async def _send(sse: SseWriter, payload: dict[str, Any] | None) -> None:
        if payload is not None:
            await sse.send(payload)

    @staticmethod
    async def _fail(sse: SseWriter, exc: KvmeshError) -> None:
        """The error event; a client already gone does not get it (nothing to log but the error)."""
        with contextlib.suppress(ClientGone):
            await sse.fail(exc)

    async def _whole(
        self, api: str, choices: Choices, gen: AsyncGenerator[tuple[int, Chunk], None]
    ) -> web.StreamResponse:
        try:
            async for p, c in gen:
                choices.add(p, c)
        except KvmeshError:
            m.REQUESTS.labels(api, "error").inc()
            raise
        finally:
            await gen.aclose()
        m.REQUESTS.labels(api, "ok").inc()
        return web.json_response(choices.whole())

    # ---- admin -------------------------------------------------------------------------------------
    def _admin(self, fn: AdminHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """An admin route: admin key, audited (who, route, key arguments, result), 415 for a non-JSON body."""

        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                with audited(SERVICE, f"{request.method} {request.path}") as args:
                    return await fn(request, args)
            except UnsupportedMediaType as e:
                return _unsupported(e)

        return openai_errors(handler)

    async def _admin_body(self, request: web.Request, schema: dict[str, type]) -> dict[str, Any]:
        """The admin body: JSON by its Content-Type, an object whose fields are those of `schema`, typed."""
        require_json(request.headers.get("Content-Type", ""))
        return typed_fields(await self._admin_json(request), schema)

    async def rebalance(self, request: web.Request, audit: dict[str, object]) -> web.StreamResponse:
        body = await self._admin_body(request, REBALANCE_BODY)
        audit.update(body)
        p, d = self.front.rebalance(_weight(body, "prefill_weight"), _weight(body, "decode_weight"))
        return web.json_response({"prefill_weight": p, "decode_weight": d})

    async def workers(self, request: web.Request, audit: dict[str, object]) -> web.StreamResponse:
        await self._auth(request, client=False)
        return web.json_response(MessageToDict(self.front.list_workers(), preserving_proto_field_name=True))

    async def drain(self, request: web.Request, audit: dict[str, object]) -> web.StreamResponse:
        body = await self._admin_body(request, DRAIN_BODY)
        audit.update(body)
        wid = body.get("worker_id")
        if not wid:
            raise InvalidArgument("worker_id", "must be a non-empty string")
        n = self.front.drain(wid, body.get("drain", True), body.get("force", False))
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
