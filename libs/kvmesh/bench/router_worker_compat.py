"""A real kvmesh worker plus the HTTP paths third-party routers probe, for the router comparison only.

sglang-router and vllm-router detect a worker with `GET /health` (and sglang with `GET /model_info` /
`GET /server_info`) before they send it traffic; the kvmesh worker serves `/healthz`. This entry point runs
the unchanged worker (`kvmesh.services.worker`) and adds those paths (200 + minimal JSON), so every router in
`python -m kvmesh.bench router --api http --compare ...` talks to the same workers.

    python -m kvmesh.bench.router_worker_compat <worker flags>
"""

from __future__ import annotations

import sys

from aiohttp import web

from kvmesh.rpc.server import ServiceRunner, run_service
from kvmesh.services.worker.__main__ import build as worker_build
from kvmesh.services.worker.settings import WorkerSettings


async def build(runner: ServiceRunner, settings: WorkerSettings) -> None:
    await worker_build(runner, settings)
    info = {"model_path": settings.model or "sim", "tokenizer_path": None, "is_generation": True}

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response(info)

    for path in ("/health", "/model_info", "/server_info", "/get_model_info", "/get_server_info"):
        runner.http_app.router.add_get(path, ok)


def main() -> int:
    return run_service("worker", WorkerSettings, build)


if __name__ == "__main__":
    sys.exit(main())
