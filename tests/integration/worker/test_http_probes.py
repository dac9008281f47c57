"""A real sim-worker process answers the probe paths vLLM's and SGLang's routers use before sending traffic."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess

pytestmark = pytest.mark.integration


def test_worker_answers_health_and_sglang_info_probes(services: Callable[..., ServiceProcess]) -> None:
    w = services("worker", "--engine", "sim", "--block-size", "32")
    with httpx.Client(base_url=f"http://127.0.0.1:{w.http_port}", timeout=10) as c:
        assert c.get("/health").status_code == 200
        for path in ("/model_info", "/server_info", "/get_model_info", "/get_server_info"):
            r = c.get(path)
            assert r.status_code == 200, path
            assert r.json()["is_generation"] is True
        assert c.get("/no_such_probe").status_code == 404
