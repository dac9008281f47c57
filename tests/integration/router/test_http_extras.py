"""vLLM's extra routes on the router (services/router/http_extras.py), in vLLM 0.32's shapes: `POST /tokenize`
(a prompt or chat messages → count, max_model_len, tokens), `POST /detokenize`, `GET /version`, and
`max_model_len` on `/v1/models`; behind the router's API keys like its OpenAI routes, bad input 400 naming
the field. Real router and simulated worker processes on loopback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import kvmesh
from kvmesh.suite.launcher import ServiceProcess
from tests.support.poll import wait_until

pytestmark = pytest.mark.integration
KEY = "sk-extras-key"
CONTEXT = 2048  # the sim worker's --max-model-len, which the router learns from its GetInfo


def post(c: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = c.post(path, json=body)
    return r.status_code, r.json()


def test_tokenize_detokenize_version_and_models(services: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    worker = services("worker", "--engine", "sim", "--block-size", "32", "--kv-blocks", "256", "--sim-speed", "0",
                      "--max-model-len", str(CONTEXT))  # fmt: skip
    router = services("router", "--workers", worker.address, "--block-size", "32", "--api-keys-file", str(keys))
    base = f"http://127.0.0.1:{router.http_port}"
    with httpx.Client(base_url=base, timeout=30) as anon:
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")):
            r = anon.request(method, path, json={"prompt": "hi"} if method == "POST" else None)
            assert r.status_code == 401, (path, r.text)  # the router's keys, as on /v1/completions
        assert anon.get("/no-such-route").status_code == 404  # unknown routes unchanged
    with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
        assert c.get("/version").json() == {"version": kvmesh.__version__}

        wait_until(lambda: post(c, "/tokenize", {"prompt": "x"})[1]["max_model_len"] == CONTEXT)
        status, tok = post(c, "/tokenize", {"prompt": "hello there", "model": None})
        assert status == 200 and set(tok) == {"count", "max_model_len", "tokens"}
        assert tok["count"] == len(tok["tokens"]) > 0 and all(isinstance(t, int) for t in tok["tokens"])
        status, detok = post(c, "/detokenize", {"tokens": tok["tokens"]})
        assert (status, detok) == (200, {"prompt": "hello there"})

        # the chat form: the tokens of the rendered conversation the router routes
        status, chat = post(c, "/tokenize", {"messages": [{"role": "user", "content": "hello there"}]})
        assert status == 200 and chat["count"] == len(chat["tokens"]) > tok["count"]
        assert "hello there" in post(c, "/detokenize", {"tokens": chat["tokens"]})[1]["prompt"]

        models = c.get("/v1/models").json()["data"]
        assert models and all(m["max_model_len"] == CONTEXT for m in models)

        bad = [
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": True}, "add_special_tokens"),
            ("/tokenize", {"prompt": "a", "typo": 1}, "typo"),
            ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "chat_template": "x"}, "chat_template"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": [10**9]}, "tokens"),  # beyond the vocabulary
        ]
        for path, body, field in bad:
            status, err = post(c, path, body)
            assert (status, err["error"]["param"]) == (400, field), (path, body, err)
        status, err = post(c, "/tokenize", {"prompt": "a", "model": "nope"})
        assert status == 404, err
