"""The aiohttp I/O the router's and the worker's OpenAI endpoints share: a bounded JSON body, the error
answer of the one table (`kvmesh.openai.errors`), a handler wrapper that turns domain errors into it, and
an SSE writer."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.openai.errors import http_error
from kvmesh.openai.responses import SSE_DONE, SSE_HEADERS, sse_event

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(exc: BaseException) -> web.Response:
    """The JSON error answer for a raised exception."""
    err = http_error(exc)
    return web.json_response(err.body, status=err.status, headers=err.headers)


def openai_errors(fn: Handler) -> Handler:
    """Wraps a handler so a domain error it raises becomes the table's answer."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except KvmeshError as e:
            return error_response(e)

    return handler


async def read_json(request: web.Request, max_bytes: int | None = None) -> dict[str, Any]:
    """The body as a JSON object; InvalidArgument("body") when larger than `max_bytes` (or the app's
    `client_max_size`), malformed, or not an object."""
    too_large = f"request body larger than {max_bytes} bytes" if max_bytes else "request body too large"
    if max_bytes is not None and request.content_length is not None and request.content_length > max_bytes:
        raise InvalidArgument("body", too_large)
    try:
        raw = await request.read()  # the whole body (bounded by the app's client_max_size)
    except web.HTTPRequestEntityTooLarge:
        raise InvalidArgument("body", too_large) from None
    if max_bytes is not None and len(raw) > max_bytes:
        raise InvalidArgument("body", too_large)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument("body", f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body


class SseWriter:
    """An SSE response: `start`, `send` events, `fail` with an error event, `finish` with `[DONE]`."""

    def __init__(self) -> None:
        self.response = web.StreamResponse(headers=SSE_HEADERS)

    async def start(self, request: web.Request) -> None:
        await self.response.prepare(request)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.response.write(sse_event(payload))

    async def fail(self, exc: BaseException) -> None:
        """An error after the stream started: the error body as the last event (the status is already 200)."""
        await self.send(http_error(exc).body)

    async def finish(self) -> web.StreamResponse:
        await self.response.write(SSE_DONE)
        await self.response.write_eof()
        return self.response
