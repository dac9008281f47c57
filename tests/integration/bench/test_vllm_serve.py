"""`python -m kvmesh.bench vllm-serve`: vLLM's own benchmark client (`vllm.benchmarks.serve`, both the
`openai` completions and the `openai-chat` backends) against a real router over simulated workers: every
request completes (zero failed), the output-token count comes from the router's answers (`max_tokens` /
`max_completion_tokens` honoured with `ignore_eos`), one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
PROMPTS, OUTPUT = 12, 4


def test_vllm_bench_serve_has_no_failed_request() -> None:
    cmd = [sys.executable, "-m", "kvmesh.bench", "vllm-serve", "--engine", "sim", "--workers", "1",
           "--num-prompts", str(PROMPTS), "--input-len", "32", "--output-len", str(OUTPUT),
           "--max-concurrency", "4", "--sim-speed", "20"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (line,) = out.stdout.strip().splitlines()
    result = json.loads(line)
    assert set(result["backends"]) == {"openai", "openai-chat"}
    for backend, figures in result["backends"].items():
        assert (figures["completed"], figures["failed"]) == (PROMPTS, 0), (backend, figures)
        assert figures["total_output_tokens"] == PROMPTS * OUTPUT and figures["ttft_p50_ms"] > 0
        assert f"--backend {backend}" in figures["client"]
