"""A stand-alone kv-sync peer for benchmarks and tests: one tier region filled with known blocks, served.

    python -m kvmesh.kvplane.kvsync.peer --block-bytes B --blocks N [--slots S] [--host H] [--stall-after K]
        [--transport auto|shm|mooncake|grpc] [--mooncake-host H]

Prints one JSON line once it serves: {"port", "shm_name", "region", "layout", "transports", "listening"}.
`--transport` auto or mooncake registers the region with this process's Mooncake Transfer Engine and offers
it (default shm: shared memory and gRPC only); `--mooncake-host` is the hostname TE publishes (a relay's, for
a peer reached through one: `listening` lists the ports the relay must carry). The blocks are
`peer_digests(N)` with data `peer_block(i, B)`, so a client knows what it should receive. `--stall-after K`
makes every ReadBlocks stream stop after K messages and print "stalled" (a test kills the peer then).
SIGTERM stops it cleanly: the server stops and the region is unlinked (a SIGKILLed peer leaves its segment to
`multiprocessing`'s resource tracker, which removes it with a "leaked shared_memory objects" warning).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import numpy as np

from kvmesh.kvplane.kvsync import mooncake
from kvmesh.kvplane.kvsync.service import REQUEST_BOUNDS, KvSyncServicer, add_to_server
from kvmesh.kvplane.kvsync.tier import TierRegion
from kvmesh.kvplane.kvsync.transport import CHOICES, MOONCAKE
from kvmesh.rpc.interceptors import InstrumentedServer, MessageBounds
from kvmesh.v1 import kvsync_pb2

REGION = "cpu"
LAYOUT = "kvsync-peer|uint8|bs32|flat"


def peer_digests(n: int) -> list[bytes]:
    """The identities of the peer's blocks (a chain, as `sha256_block_ids` makes them)."""
    out, prev = [], hashlib.sha256(b"kvsync-peer").digest()
    for _ in range(n):
        prev = hashlib.sha256(prev).digest()
        out.append(prev)
    return out


def peer_block(i: int, block_bytes: int) -> bytes:
    """The data of block i."""
    return np.random.default_rng(i).integers(0, 256, block_bytes, dtype=np.uint8).tobytes()


class BreakingKvSync(KvSyncServicer):
    """A KvSyncService whose ReadBlocks stream breaks after `messages` messages, as a peer's does when it is
    killed (the stream ends UNAVAILABLE) or, with `stall`, when it hangs (the stream stays open and sends
    nothing); `stalled` is set and `on_break` called at the break (the peer process prints "stalled")."""

    def __init__(
        self,
        *args: Any,
        messages: int = 1 << 30,
        stall: bool = False,
        on_break: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.messages, self.stall, self.on_break = messages, stall, on_break
        self.stalled = asyncio.Event()

    async def ReadBlocks(  # type: ignore[override]
        self, request: kvsync_pb2.ReadBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        sent = 0
        async for raw in super().ReadBlocks(request, context):
            if sent == self.messages:
                if self.on_break is not None:
                    self.on_break()
                if self.stall:
                    self.stalled.set()
                    await asyncio.Event().wait()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "peer went away")
            yield raw
            sent += 1


async def serve(args: argparse.Namespace) -> None:
    shm_name = f"kvmesh-peer-{os.getpid()}"
    region = TierRegion.create(shm_name, args.block_bytes, max(args.slots, args.blocks, 1), LAYOUT)
    try:
        for i, digest in enumerate(peer_digests(args.blocks)):
            region.put(digest, peer_block(i, args.block_bytes), now_ns=0)
        mooncake.configure(args.mooncake_host or args.host)
        offer = args.transport in ("auto", MOONCAKE)
        servicer: KvSyncServicer
        if args.stall_after >= 0:
            stalled = lambda: print("stalled", flush=True)  # noqa: E731
            servicer = BreakingKvSync(
                {REGION: region}, messages=args.stall_after, stall=True, on_break=stalled, mooncake=offer
            )
        else:
            servicer = KvSyncServicer({REGION: region}, mooncake=offer)
        opts: Sequence[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", 8 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ]
        server = grpc.aio.server(options=opts)
        add_to_server(servicer, InstrumentedServer(server, "kvsync-peer", MessageBounds(per_method=REQUEST_BOUNDS)))
        port = server.add_insecure_port(f"{args.host}:0")
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        info = {"port": port, "shm_name": shm_name, "region": REGION, "layout": LAYOUT}
        transports = servicer.transports(REGION)
        # every port this process listens on once its TE runs (gRPC's, TE's handshake and data ports)
        listening = mooncake.listening_ports() if MOONCAKE in transports else []
        print(json.dumps({**info, "transports": transports, "listening": listening}), flush=True)
        await stop.wait()
        await server.stop(None)
        servicer.close()
    finally:
        region.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.kvplane.kvsync.peer")
    p.add_argument("--block-bytes", type=int, required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--slots", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--stall-after", type=int, default=-1)
    p.add_argument("--transport", choices=CHOICES, default="shm")
    p.add_argument("--mooncake-host", default="", help="the hostname TE publishes to peers (default --host)")
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
