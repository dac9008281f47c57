"""vLLM's extra HTTP routes on the router, in vLLM 0.32's shapes (vllm/entrypoints/serve/tokenize and
instrumentator), beside the OpenAI ones of `http_api.py` and behind the same keys, signatures and tenants:

    POST /tokenize      {"prompt": str} | {"messages": [...]}  → {"count", "max_model_len", "tokens"}
    POST /detokenize    {"tokens": [int]}                      → {"prompt": str}
    GET  /version                                              → {"version": kvmesh's version}

The tokens are those the router routes the same text with (its tokenizer, its chat rendering); the options
that would change them are refused naming them (`kvmesh.openai.protocol.parse_tokenize`). `max_model_len` is
the smallest context of the workers the router knows (their GetInfo), the router's `max_prompt_tokens`
until it knows one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

import kvmesh
from kvmesh.openai.aio import openai_errors, parse_json_object
from kvmesh.openai.protocol import check_text, parse_detokenize, parse_tokenize
from kvmesh.security.client_keys import bind_tenant
from kvmesh.services.router.frontend import Frontend
from kvmesh.services.router.limits import check_token_ids

if TYPE_CHECKING:
    from kvmesh.services.router.http_api import HttpApi


def max_model_len(front: Frontend) -> int:
    """The smallest context length of the pool's workers (GetInfo), else the router's prompt limit."""
    known = [h.max_model_len for h in front.core.pool.handles if h.max_model_len]
    return min(known) if known else front.limits.max_prompt_tokens


class HttpExtras:
    """The extra routes, authorised as `HttpApi`'s client routes (its `_auth`: key, signature, rate limit)."""

    def __init__(self, api: HttpApi, tenant_header: str) -> None:
        self.api = api
        self.tenant_header = tenant_header

    def install(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", openai_errors(self.tokenize))
        app.router.add_post("/detokenize", openai_errors(self.detokenize))
        app.router.add_get("/version", openai_errors(self.version))

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        front = self.api.front
        ident, raw = await self.api._auth(request)
        tenant = bind_tenant(ident, check_text(request.headers.get(self.tenant_header) or "", self.tenant_header))
        req = parse_tokenize(parse_json_object(raw))
        front.lora_for(req.model, "")  # an unknown model is 404, as on the generation routes
        if req.prompt is not None:
            prompt = await front.tokenize_text(req.prompt, tenant)
        else:
            prompt = await front.tokenize_chat(req.messages, tenant)
        ids = prompt.array.tolist()
        return web.json_response({"count": len(ids), "max_model_len": max_model_len(front), "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        front = self.api.front
        _, raw = await self.api._auth(request)
        model, tokens = parse_detokenize(parse_json_object(raw))
        front.lora_for(model, "")
        check_token_ids(tokens, front.limits.vocab_size, "tokens")
        return web.json_response({"prompt": front.tokenizer.decode(tokens)})

    async def version(self, request: web.Request) -> web.StreamResponse:
        await self.api._auth(request)
        return web.json_response({"version": kvmesh.__version__})
