"""A ZMQ subscriber decodes a simulated worker's KV events with vLLM's own msgspec classes, live and
through the replay socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvmesh.suite.launcher import start_service
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration
BS = 16


async def test_vllm_classes_decode_live_and_replayed_events(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    pub, rep = f"ipc://{tmp_path}/kv.pub", f"ipc://{tmp_path}/kv.replay"
    sp = start_service(
        "worker",
        tmp_path,
        "--engine",
        "sim",
        "--block-size",
        str(BS),
        "--kv-blocks",
        "512",
        "--sim-speed",
        "0",
        "--zmq-publish",
        pub,
        "--zmq-replay",
        rep,
        "--zmq-topic",
        "kv",
    )
    ctx = zmq.asyncio.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub)
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        prompts = [list(range(1000 * i, 1000 * i + 3 * BS + 1)) for i in (1, 2, 3)]
        async with grpc.aio.insecure_channel(sp.address) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            for i, p in enumerate(prompts):
                req = worker_pb2.GenerateRequest(
                    request_id=f"r{i}",
                    token_ids=common_pb2.TokenIds(ids=p),
                    sampling=common_pb2.SamplingParams(max_tokens=1),
                )
                [m async for m in stub.Generate(req, timeout=10)]
        live: list[int] = []
        async with asyncio.timeout(10):  # PUB/SUB may drop what was sent before the subscription landed
            while True:
                topic, seq_b, payload = await sub.recv_multipart()
                assert topic == b"kv" and len(seq_b) == 8
                live.append(int.from_bytes(seq_b, "big"))
                if any(
                    prompts[-1][:BS] == list(e.token_ids)[:BS]
                    for e in dec.decode(payload).events
                    if isinstance(e, BlockStored)
                ):
                    break
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(rep)
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed: list[tuple[int, KVEventBatch]] = []
        async with asyncio.timeout(10):
            while True:
                _, _topic, seq_b, payload = await dealer.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == -1:
                    break
                replayed.append((seq, dec.decode(payload)))
        assert [s for s, _ in replayed] == list(range(1, len(replayed) + 1))
        assert set(live) <= {s for s, _ in replayed}
        stored = [e for _, b in replayed for e in b.events if isinstance(e, BlockStored)]
        assert [list(e.token_ids) for e in stored] == [p[: 3 * BS] for p in prompts]
        assert all(e.parent_block_hash is None and e.block_size == BS for e in stored)
        dealer.close(linger=0)
        sub.close(linger=0)
    finally:
        ctx.destroy(linger=0)
        assert sp.terminate(timeout=30) == 0
