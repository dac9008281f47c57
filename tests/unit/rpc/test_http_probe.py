"""vLLM's probe answer (`kvmesh.rpc.server.probe`, the router's GET /health and GET|POST /ping): 200 with an empty
body while the service serves, 503 once it drains, as vLLM answers once its engine is dead."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvmesh.rpc.server import STOPPING, probe

pytestmark = pytest.mark.unit


async def test_200_and_no_body_while_serving_503_once_draining() -> None:
    app = web.Application()
    app[STOPPING] = asyncio.Event()
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        reply = await probe(make_mocked_request(method, path, app=app))
        assert (reply.status, reply.body) == (200, None), (method, path)
    app[STOPPING].set()
    assert (await probe(make_mocked_request("GET", "/health", app=app))).status == 503
