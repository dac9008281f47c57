"""What the router's request path streams to its doors (`Chunk`), made from a worker's `GenerateResponse` at
the edge (`chunk_of`): the worker's protobuf log-probabilities become the domain's here, once, so neither
door (gRPC servicer, HTTP API) reads a worker message.

With `n > 1` the chunks of the request's sequences interleave, each naming its sequence (`index`); a chunk
with a finish reason ends its own sequence only, and the request's last chunk (the one with `usage`) ends
the last sequence still running.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.generation import PositionLogprobs
from kvmesh.v1 import common_pb2, worker_pb2
from kvmesh.wire.proto import logprobs_from_proto

Logprobs = tuple[PositionLogprobs | None, ...]  # per position; None only for a prompt's first token


@dataclass(slots=True)
class Chunk:
    """One streamed step to the client (`finish_reason` on its sequence's last one, `usage` on the
    request's last one); `index`: which of the request's `n` sequences it continues; `logprobs`: one per
    token id when asked for; `prompt_logprobs`: the prompt's, on the first chunk only, when asked for."""

    token_ids: list[int]
    text: str
    worker_id: str
    migrations: int
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None
    index: int = 0
    logprobs: Logprobs = ()
    prompt_logprobs: Logprobs = ()


def chunk_of(
    resp: worker_pb2.GenerateResponse,
    worker_id: str,
    migrations: int,
    finish: int = common_pb2.FINISH_REASON_UNSPECIFIED,
    usage: common_pb2.Usage | None = None,
) -> Chunk:
    """A worker's step as a chunk (log-probabilities converted only when the step carries some)."""
    return Chunk(
        list(resp.token_ids),
        resp.text,
        worker_id,
        migrations,
        finish,
        usage,
        resp.index,
        logprobs_from_proto(resp.logprobs) if resp.logprobs else (),
        logprobs_from_proto(resp.prompt_logprobs) if resp.prompt_logprobs else (),
    )
