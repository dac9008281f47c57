"""A stock `openai` client drives a simulated worker through its OpenAI-compatible HTTP endpoint."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kvmesh.suite.launcher import ServiceProcess, start_service

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    sp = start_service(
        "worker",
        tmp_path_factory.mktemp("w"),
        "--engine",
        "sim",
        "--block-size",
        "16",
        "--kv-blocks",
        "1024",
        "--sim-speed",
        "100",
        "--max-model-len",
        "4096",
    )
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest.fixture
def client(worker: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{worker.http_port}/v1", api_key="unused", max_retries=0)


def test_models_and_completion(client: openai.OpenAI) -> None:
    (model,) = [m.id for m in client.models.list()]
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    r = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(prompt.encode())  # the sim's byte tokenizer
    again = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    assert again.choices[0].text == r.choices[0].text  # greedy: same prompt, same output
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt.encode()) - 1) // 16 * 16


def test_streaming_completion_and_chat(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="m", prompt=[5, 6, 7, 8], max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6 and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    chat = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
        )
    )
    assert chat[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chat if c.choices[0].delta.content) == 3
    assert chat[-1].choices[0].finish_reason == "length"
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert whole.choices[0].message.content and whole.usage is not None and whole.usage.completion_tokens == 2


def test_errors_have_openai_shape(client: openai.OpenAI, worker: ServiceProcess) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="m", prompt="x", max_tokens=9000)
    assert ei.value.param == "max_tokens"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", temperature=-2)
    r = httpx.post(f"http://127.0.0.1:{worker.http_port}/v1/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    metrics = httpx.get(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=10).text
    assert "kvmesh_prefill_tokens_total" in metrics and "kvmesh_worker_ttft_seconds_count" in metrics
