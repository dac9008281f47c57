"""One attempt of a request on one worker (`Attempt`: its request's wire bytes, its call, its stall watch), and
the worker request it sends: where the router's domain request becomes `worker_pb2` bytes, so the request
path above holds no protobuf of its own."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvmesh.core.pull import KvPull
from kvmesh.routing.attempts import NextAttempt
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.stall_watch import StallWatch
from kvmesh.services.router.worker_stream import WorkerCall, attempt_request_bytes
from kvmesh.services.router.workers import WorkerHandle
from kvmesh.v1 import worker_pb2
from kvmesh.wire.proto import pull_to_proto, sampling_to_proto


@dataclass(slots=True)
class Attempt:
    """One attempt of a request on one worker: its request bytes, call, stall watch; `hedge`: a second try
    racing the first for its first token (`hedging`)."""

    request_id: str
    wid: str
    h: WorkerHandle
    request: bytes
    n_new: int  # prompt tokens the worker has to compute (not cached there)
    kv_tokens: int
    watch: StallWatch
    sequences: int = 1  # the request's n: its call ends once each has finished
    call: WorkerCall | None = None
    hedge: bool = False
    _it: AsyncIterator[worker_pb2.GenerateResponse] | None = None

    @property
    def it(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The call's steps (one iterator per attempt: a step read by a racer is not read again)."""
        if self._it is None:
            assert self.call is not None
            self._it = aiter(self.call)
        return self._it

    async def send(self, carrier: dict[str, str]) -> None:
        """Sends the attempt's request to its worker (`carrier`: the trace context); the stall watch's clock
        starts."""
        self.call = await self.h.generate(self.request_id, self.request, carrier, self.sequences)
        self.watch.sent(time.monotonic())

    def take(self, other: Attempt) -> None:
        """Becomes `other` (a hedge that won)."""
        for name in self.__slots__:
            setattr(self, name, getattr(other, name))


def worker_request(rid: str, req: RouterRequest, plan: NextAttempt, so_far: list[int], pull: KvPull | None) -> bytes:
    """Wire bytes of an attempt's `GenerateRequest`: the request's sampling as `plan` adjusts it, its prompt's
    wire bytes as they are followed by `so_far` (the tokens a migration resumes from), the `pull` placement
    chose (its `KvPullHint`)."""
    hint = pull_to_proto(pull) if pull is not None else None
    head = worker_pb2.GenerateRequest(
        request_id=rid,
        tenant=req.tenant,
        lora_name=req.lora,
        detokenize=True,
        kv_pull=hint,
        resumed_output_tokens=len(so_far),
    )
    return attempt_request_bytes(head, sampling_to_proto(req.sampling), plan, req.prompt.wire, so_far)
