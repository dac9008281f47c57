"""The aiohttp I/O the router's and the worker's OpenAI endpoints share: a bounded JSON body, the error
answer of the one table (`kvmesh.openai.errors`), a handler wrapper that turns domain errors into it, and
an SSE writer (a client that goes away mid-stream is `ClientGone`, logged at INFO by the handler)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvmesh.core.errors import InvalidArgument, KvmeshError
from kvmesh.openai.errors import http_error
from kvmesh.openai.responses import SSE_DONE, SSE_HEADERS, sse_event

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BODY_TIMEOUT_S = 30.0  # default longest wait for a request body (a Content-Length larger than what is sent)


class ClientGone(Exception):
    """The HTTP client closed the connection while its SSE stream was being written."""


class BodyTimeout(Exception):
    """The request body did not arrive in time (answered 408, connection closed)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request body not received within {timeout_s:g}s")


def error_response(exc: BaseException) -> web.Response:
    """The JSON error answer for a raised exception."""
    err = http_error(exc)
    return web.json_response(err.body, status=err.status, headers=err.headers)


def body_timeout_response(exc: BodyTimeout) -> web.Response:
    """408 in OpenAI's error shape; the connection is closed (the rest of the body may never come)."""
    body = {"error": {"message": str(exc), "type": "invalid_request_error", "param": "body", "code": 408}}
    response = web.json_response(body, status=408)
    response.force_close()
    return response


def openai_errors(fn: Handler) -> Handler:
    """Wraps a handler so a domain error it raises becomes the table's answer."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except KvmeshError as e:
            return error_response(e)
        except BodyTimeout as e:
            log.info("%s %s: %s", request.method, request.path, e)
            return body_timeout_response(e)

    return handler


async def read_json(
    request: web.Request, max_bytes: int | None = None, timeout_s: float = BODY_TIMEOUT_S
) -> dict[str, Any]:
    """The body as a JSON object (`read_body`, then `parse_json_object`)."""
    return parse_json_object(await read_body(request, max_bytes, timeout_s))


async def read_body(request: web.Request, max_bytes: int | None = None, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The whole body; InvalidArgument("body") when larger than `max_bytes` (or the app's `client_max_size`),
    HTTP 408 when it does not arrive within `timeout_s`. aiohttp keeps it: a second read returns the same bytes."""
    too_large = f"request body larger than {max_bytes} bytes" if max_bytes else "request body too large"
    if max_bytes is not None and request.content_length is not None and request.content_length > max_bytes:
        raise InvalidArgument("body", too_large)
    try:  # the whole body (bounded by the app's client_max_size), within the timeout
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise InvalidArgument("body", too_large) from None
    except TimeoutError:
        raise BodyTimeout(timeout_s) from None
    if max_bytes is not None and len(raw) > max_bytes:
        raise InvalidArgument("body", too_large)
    return raw


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object; InvalidArgument("body") when malformed, nested too deep or not an object."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument("body", f"malformed JSON: {e}") from None
    except RecursionError:
        raise InvalidArgument("body", "malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body


class SseWriter:
    """An SSE response: `start`, `send` events, `fail` with an error event, `finish` with `[DONE]`."""

    def __init__(self) -> None:
        self.response = web.StreamResponse(headers=SSE_HEADERS)

    async def start(self, request: web.Request) -> None:
        await self._write(self.response.prepare(request))

    async def send(self, payload: dict[str, Any]) -> None:
        await self._write(self.response.write(sse_event(payload)))

    @staticmethod
    async def _write(op: Awaitable[object]) -> None:
        """Awaits a write; a closed connection is ClientGone (expected: no traceback)."""
        try:
            await op
        except ConnectionResetError as e:  # aiohttp's ClientConnectionResetError is one
            raise ClientGone(str(e)) from None

    async def fail(self, exc: BaseException) -> None:
        """An error after the stream started: the error body as the last event (the status is already 200)."""
        await self.send(http_error(exc).body)

    async def finish(self) -> web.StreamResponse:
        await self._write(self.response.write(SSE_DONE))
        await self._write(self.response.write_eof())
        return self.response


def client_gone(request: web.Request, response: web.StreamResponse, exc: ClientGone) -> web.StreamResponse:
    """Logs an SSE client's disconnect at INFO (no traceback) and returns the response aiohttp expects."""
    log.info("%s %s: client disconnected mid-stream (%s)", request.method, request.path, exc)
    return response
