"""Rolling upgrade: a worker that does not offer `GenerateStream` in GetInfo (an older version) still gets
requests from a router whose default transport is the stream, as one `Generate` call each.

The older worker is a stand-in written here (a sync grpc server in this process serving GetInfo, StreamLoad
and Generate only, as a worker before GenerateStream did); the router is the real process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration


class OlderWorker(worker_pb2_grpc.WorkerServiceServicer):
    """GetInfo without `generate_stream`; GenerateStream is left UNIMPLEMENTED (the generated base class)."""

    def __init__(self) -> None:
        self.generate_calls: list[list[int]] = []
        self.stopped = threading.Event()

    def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.ServicerContext) -> worker_pb2.GetInfoResponse:
        return worker_pb2.GetInfoResponse(
            worker_id="old-1",
            engine="sim",
            model="m",
            block_size=32,
            kv_blocks_total=1000,
            max_model_len=4096,
            zone="local",
        )

    def StreamLoad(
        self, request: worker_pb2.StreamLoadRequest, context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.StreamLoadResponse]:
        while context.is_active() and not self.stopped.is_set():
            yield worker_pb2.StreamLoadResponse(
                report=common_pb2.LoadReport(worker_id="old-1", kv_blocks_total=1000, max_queue=100)
            )
            self.stopped.wait(request.interval_ms / 1000)  # the report interval, not a synchronisation

    def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.GenerateResponse]:
        self.generate_calls.append(list(request.token_ids.ids))
        n = request.sampling.max_tokens
        for k in range(n):
            last = k == n - 1
            yield worker_pb2.GenerateResponse(
                token_ids=[40 + k],
                worker_id="old-1",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                usage=common_pb2.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=n) if last else None,
            )


def test_router_uses_generate_calls_for_a_worker_without_the_stream(
    services: Callable[..., ServiceProcess],
) -> None:
    fake = OlderWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        router = services("router", "--workers", f"127.0.0.1:{port}", "--block-size", "32")
        with grpc.insecure_channel(router.address) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            for i in range(3):
                req = router_pb2.RouterServiceGenerateRequest(
                    token_ids=common_pb2.TokenIds(ids=list(range(5 + i, 105 + i))),
                    sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
                )
                msgs = list(stub.Generate(req, timeout=30))
                assert [t for m in msgs for t in m.token_ids] == [40, 41, 42, 43]
                assert msgs[-1].worker_id == "old-1" and msgs[-1].usage.completion_tokens == 4
        assert fake.generate_calls == [list(range(5 + i, 105 + i)) for i in range(3)]
    finally:
        fake.stopped.set()
        server.stop(grace=None)
