"""vLLM's sampling extensions through the router's OpenAI API reach the worker's engine (nothing parsed and
dropped on the way): `logit_bias` and `allowed_token_ids` decide the simulated engine's tokens, the other
fields are accepted, and a structured output, which the simulated engine cannot apply, is refused (400)
rather than ignored. Real router and simulated worker processes on loopback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess

pytestmark = pytest.mark.integration
BASE = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "temperature": 1.0, "seed": 3}


def post(c: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = c.post(path, json=body)
    return r.status_code, r.json()


def test_sampling_fields_reach_the_engine(services: Callable[..., ServiceProcess]) -> None:
    worker = services("worker", "--engine", "sim", "--block-size", "32", "--kv-blocks", "256", "--sim-speed", "0")
    router = services("router", "--workers", worker.address, "--block-size", "32")
    with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}", timeout=30) as c:
        status, tok = post(c, "/tokenize", {"prompt": "AB"})
        assert status == 200 and tok["count"] == 2
        chat = {"messages": [{"role": "user", "content": "hi"}]} | {k: v for k, v in BASE.items() if k != "prompt"}
        texts = set()
        for t in tok["tokens"]:  # the token forced or the only one allowed: one token repeated (the worker's
            for extra in ({"logit_bias": {str(t): 100}}, {"allowed_token_ids": [t]}):  # text of it)
                status, out = post(c, "/v1/completions", BASE | extra)
                assert status == 200, out
                text = out["choices"][0]["text"]
                status, out = post(c, "/v1/chat/completions", chat | extra)
                assert status == 200 and out["choices"][0]["message"]["content"] == text, (extra, out)
                assert len(text) == 4 and len(set(text)) == 1, (extra, text)
                texts.add(text)
        assert len(texts) == 2  # one text per token id: the engine applied each
        accepted = {"min_p": 0.1, "bad_words": ["zz"], "include_stop_str_in_output": True,
                    "skip_special_tokens": False, "priority": -3}  # fmt: skip
        status, out = post(c, "/v1/completions", BASE | accepted)
        assert status == 200 and out["usage"]["completion_tokens"] == 4, out
        for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "[ab]+"}}):
            status, out = post(c, "/v1/completions", BASE | extra)
            assert status == 400 and "schema or grammar" in out["error"]["message"], (extra, out)  # the worker's
            assert out["error"]["param"] == "structured_outputs", out  # the field the worker named
        status, out = post(c, "/v1/completions", BASE | {"logit_bias": {"999999999": 1}})
        assert (status, out["error"]["param"]) == (400, "logit_bias"), out  # outside the vocabulary
