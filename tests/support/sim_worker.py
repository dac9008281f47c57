"""A real worker process with the simulated engine, and generation requests for it (worker-level tests)."""

from __future__ import annotations

from pathlib import Path

from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, worker_pb2

BS = 16  # tokens per KV block of these workers


def start_sim_worker(tmp: Path, *flags: str) -> ServiceProcess:
    """A sim worker (2048 blocks of `BS` tokens, 8192-token context); `flags` add to / override those."""
    return start_service(
        "worker",
        tmp,
        "--engine",
        "sim",
        "--block-size",
        str(BS),
        "--kv-blocks",
        "2048",
        "--max-model-len",
        "8192",
        *flags,
        timeout=60,
    )


def gen_req(rid: str, ids: list[int], max_tokens: int = 4, **kw: object) -> worker_pb2.GenerateRequest:
    """A greedy generation request for `ids`."""
    return worker_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        **kw,  # type: ignore[arg-type]
    )
