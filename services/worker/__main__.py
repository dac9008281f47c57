"""Entry point: `python -m kvmesh.services.worker` / `kvmesh-worker`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvmesh.core.cpus import parse_cpu_list, pin_process
from kvmesh.discovery.model import WORKER_ROLE_META
from kvmesh.rpc.server import DEFAULT_MAX_REQUEST_BYTES, BoundPorts, ServiceRunner, run_service
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.admission import WindowGate, window_config
from kvmesh.services.worker.app import WorkerApp
from kvmesh.services.worker.engine_factory import build_engine, engine_handoff, model_name
from kvmesh.services.worker.generate_frames import FramesListener
from kvmesh.services.worker.kvpull import TIER_REGION, KvSyncServer, peer_pulls
from kvmesh.services.worker.openai_http import OpenAIApi
from kvmesh.services.worker.pusher import CacheManagerPusher
from kvmesh.services.worker.servicer import WorkerServicer
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.services.worker.zmq_pub import ZmqKvPublisher
from kvmesh.v1 import worker_pb2_grpc


async def build(runner: ServiceRunner, settings: WorkerSettings) -> None:
    """The cost gauges and the batching window (a bad price or window fails before anything starts), CPU
    affinity (the engine's processes inherit it), the engine (vLLM takes seconds), then the servicer, the OpenAI
    routes and the KV event sinks."""
    m.set_cost(settings.gpus, settings.gpu_hour_price)
    window = window_config(settings)
    if settings.cpu_affinity:
        pin_process(parse_cpu_list(settings.cpu_affinity))
    pulls = peer_pulls(settings)
    engine = build_engine(settings, peers=pulls)
    await engine.start()
    app = WorkerApp(engine, settings.engine, settings.service_id or "worker", buffer=settings.kv_event_buffer)
    app.engine_handoff = engine_handoff(engine)
    app.gate = WindowGate(window) if window is not None else None
    region = engine.served_tier()
    kvsync = KvSyncServer(region, settings) if region is not None else None
    if kvsync is not None:
        app.kvsync_address = await kvsync.start()
        app.tier_region, app.tier_shm_name = TIER_REGION, kvsync.region.shm_name
        app.tier_blocks_total = kvsync.region.num_slots
        app.tier_block_bytes = kvsync.region.block_bytes
    servicer = WorkerServicer(app, settings, kvsync.holds if kvsync is not None else None)
    runner.add_servicer(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer, "kvmesh.v1.WorkerService")
    frames = None
    if settings.frames_port >= 0:  # the same requests, bound and guard as GenerateStream
        bound = runner.limits.grpc_requests.largest or DEFAULT_MAX_REQUEST_BYTES
        frames = FramesListener(servicer.outputs, app.stopping, runner.guard, settings, bound)
        app.frames_address = await frames.start()
    OpenAIApi(engine, model_name(settings), app.gate).add_routes(runner.http_app)
    pusher = CacheManagerPusher(app, settings.cache_manager, settings) if settings.cache_manager else None
    zpub: list[ZmqKvPublisher] = []

    async def started(ports: BoundPorts) -> None:
        app.set_worker_id(runner.service_id)
        await runner.set_meta(WORKER_ROLE_META, settings.worker_role.value)  # the registry names the role
        app.address = ports.grpc_address
        if settings.zmq_publish:
            pub = ZmqKvPublisher(
                settings.zmq_publish, settings.zmq_replay, settings.zmq_topic, settings.kv_event_buffer
            )
            zpub.append(pub)
            app.sinks.append(pub.publish)
        app.start()
        if pusher is not None:
            pusher.start()

    async def stopping() -> None:
        app.stopping.set()

    async def stopped() -> None:
        if pusher is not None:
            await pusher.stop()
        if frames is not None:
            await frames.stop()
        await app.stop()
        if kvsync is not None:
            await kvsync.stop()
        await pulls.close()
        for pub in zpub:
            await pub.close()
        await engine.stop()

    runner.on_started.append(started)
    runner.on_stopping.append(stopping)
    runner.on_stopped.append(stopped)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("worker", WorkerSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
