"""Builds the worker's engine from its settings."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from kvmesh.engine.base import Engine
from kvmesh.engine.clock import Clock, RealClock, VirtualClock
from kvmesh.engine.sim.core import SimConfig
from kvmesh.engine.sim.driver import SimEngine
from kvmesh.engine.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer
from kvmesh.errors import FailedPrecondition, InvalidArgument
from kvmesh.services.worker.settings import WorkerSettings

SIM_MODEL_NAME = "sim-llama-3.1-70b-fp8"


def tiny_model_dir() -> Path:
    """Where scripts/build_tiny_model.py puts the tiny test model."""
    home = os.environ.get("KVMESH_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "kvmesh") / "models" / "tiny-llama"


def model_name(s: WorkerSettings) -> str:
    if s.engine == "sim":
        return s.model or SIM_MODEL_NAME
    return s.model or str(tiny_model_dir())


def build_engine(s: WorkerSettings) -> Engine:
    if s.engine == "sim":
        tok: Tokenizer = ByteTokenizer()
        vocab = 128256
        if s.model and (Path(s.model) / "tokenizer.json").exists():
            hf = HfTokenizer(s.model)
            tok, vocab = hf, hf.vocab_size
        cfg = SimConfig(
            block_size=s.block_size,
            num_blocks=s.kv_blocks,
            max_waiting=s.max_queue,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            vocab_size=vocab,
        )
        clock: Clock = VirtualClock() if s.sim_speed == 0 else RealClock(s.sim_speed)
        return SimEngine(cfg, model_name=model_name(s), clock=clock, tokenizer=tok)
    if s.engine == "vllm":
        from kvmesh.engine.vllm_engine import VllmEngine, VllmEngineConfig

        model = model_name(s)
        if not s.model and not Path(model).exists():
            raise FailedPrecondition(f"no model given and {model} is missing: run scripts/build_tiny_model.py")
        return VllmEngine(
            VllmEngineConfig(
                model=model,
                block_size=s.block_size,
                max_model_len=s.max_model_len,
                dtype=s.vllm_dtype,
                extra_args=tuple(shlex.split(s.vllm_args)),
                cpu_kvcache_space_gib=s.vllm_cpu_kvcache_gib,
            )
        )
    raise InvalidArgument("engine", f"unknown engine {s.engine!r} (sim or vllm)")
