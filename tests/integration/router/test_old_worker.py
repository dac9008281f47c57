"""A worker that does not offer `GenerateStream` in GetInfo (a version older than the router's transports) is
never routed to: the router logs why (upgrade the worker), sends it no request, and its clients get
UNAVAILABLE rather than a request on a transport the worker lacks.

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
from tests.support.poll import wait_until

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


def test_router_does_not_route_to_a_worker_without_the_stream(
    services: Callable[..., ServiceProcess],
) -> None:
    fake = OlderWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        router = services("router", "--workers", f"127.0.0.1:{port}", "--block-size", "32")
        wait_until(lambda: "does not serve GenerateStream" in router.log())
        with grpc.insecure_channel(router.address) as ch:
            req = router_pb2.RouterServiceGenerateRequest(
                token_ids=common_pb2.TokenIds(ids=list(range(5, 105))),
                sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
            )
            with pytest.raises(grpc.RpcError) as ei:
                list(router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=30))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert fake.generate_calls == []
    finally:
        fake.stopped.set()
        server.stop(grace=None)
