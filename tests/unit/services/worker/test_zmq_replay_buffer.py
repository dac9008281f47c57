"""The ZMQ publisher's replay buffer is bounded in payload bytes as well as batches, and a replay through a
real DEALER socket returns the newest batches it kept, then the end marker."""

from __future__ import annotations

import zmq
import zmq.asyncio

from kvmesh.core.kvevents import BlockStored, KvEventBatch
from kvmesh.services.worker.zmq_pub import ZmqKvPublisher
from kvmesh.wire.vllm_events import END_SEQ, decode_seq, encode_payload, encode_seq


def big_batch(seq: int, blocks: int = 96) -> KvEventBatch:
    ev = BlockStored(tuple(range(seq * 1000, seq * 1000 + blocks)), None, tuple(range(blocks * 32)), 32)
    return KvEventBatch("w", "i", seq, float(seq), (ev,))


async def test_the_replay_buffer_holds_at_most_its_bytes_and_replays_the_newest() -> None:
    size = len(encode_payload(big_batch(1)))
    pub = ZmqKvPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer=10_000, buffer_bytes=5 * size)
    try:
        for seq in range(1, 201):  # 200 batches: 40 times what the bytes allow
            pub.publish(big_batch(seq))
        assert pub.buffered_bytes <= 5 * size
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        await dealer.send_multipart((b"", encode_seq(1)))
        seqs = []
        while True:
            _empty, _topic, seq, _payload = await dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(decode_seq(seq))
        dealer.close(linger=0)
        ctx.destroy(linger=0)
        # the newest, contiguous, as many as fit (later batches' ids encode a little longer than batch 1's)
        assert 4 <= len(seqs) <= 5 and seqs == list(range(201 - len(seqs), 201))
        assert sum(len(encode_payload(big_batch(s))) for s in seqs) == pub.buffered_bytes
    finally:
        await pub.close()


async def test_a_count_bound_still_applies_to_small_batches() -> None:
    pub = ZmqKvPublisher("tcp://127.0.0.1:*", buffer=3)
    try:
        for seq in range(1, 11):
            pub.publish(big_batch(seq, blocks=1))
        assert pub.buffered_bytes == 3 * len(encode_payload(big_batch(10, blocks=1)))
    finally:
        await pub.close()
