"""One attempt of a request on one worker (`Attempt`: its request's wire bytes, its call, its stall watch), and
the worker request it sends: where the router's domain request becomes `worker_pb2` bytes, so the request
path above holds no protobuf of its own."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvmesh.core.handoff import KvHandoff
from kvmesh.core.pull import KvPull
from kvmesh.routing.attempts import NextAttempt
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.stall_watch import StallWatch
from kvmesh.services.router.worker_stream import WorkerCall, attempt_request_bytes
from kvmesh.services.router.workers import WorkerHandle
from kvmesh.v1 import worker_pb2
from kvmesh.wire.proto import handoff_to_proto, pull_to_proto, sampling_to_proto


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
    cached: int | None = None  # a decode half's: the prompt tokens its prefill worker found cached
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


def worker_request(
    rid: str,
    req: RouterRequest,
    plan: NextAttempt,
    so_far: list[int],
    pull: KvPull | None,
    handoff: KvHandoff | None = None,
    engine_handoff: bool = False,
) -> bytes:
    """Wire bytes of an attempt's `GenerateRequest`: the request's sampling as `plan` adjusts it, its prompt's
    wire bytes as they are followed by `so_far` (the tokens a migration resumes from), the `pull` placement
    chose (its `KvPullHint`). A decode half carries its `handoff`: by the engine's own transfer when the
    decode worker has one (`engine_handoff`) and the prefill worker gave its parameters, else as the kv-sync
    pull from the prefill worker's tier (its `kv_pull`)."""
    if handoff is not None:
        if not (engine_handoff and handoff.engine_params_json):
            pull = handoff.pull
            handoff = dataclasses.replace(handoff, engine_params_json="")
        else:
            pull = None
    hint = pull_to_proto(pull) if pull is not None else None
    head = worker_pb2.GenerateRequest(
        request_id=rid,
        tenant=req.tenant,
        lora_name=req.lora,
        detokenize=True,
        kv_pull=hint,
        resumed_output_tokens=len(so_far),
        handoff=handoff_to_proto(handoff) if handoff is not None else None,
    )
    return attempt_request_bytes(head, sampling_to_proto(req.sampling), plan, req.prompt.wire, so_far)
