"""SIGTERM of a cache-manager with its long-lived streams open: it exits well within its grace period.

A worker keeps its PublishKvEvents stream open between batches and a follower keeps WatchIndex open for
good; the graceful drain waits for in-flight calls, so a stream still waiting on its peer used to hold the
process for the whole grace period. Now the publish stream fails UNAVAILABLE (the worker reconnects, to the
restarted cache-manager or another) and the watch ends cleanly, and the process exits at once.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
from collections.abc import Callable

import grpc
import pytest

from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc
from tests.integration.cache_manager.test_grpc import Publisher, start_cm, workload
from tests.support.procs import ServiceProcess
from tests.unit.cachemgr.test_ingest_state import ToyEngine

GRACE_S = 30.0  # far above a prompt exit even on two busy cores; the old behaviour took all of it
EXIT_WITHIN_S = 20.0  # bounded wait for the exit: before the fix the process was still draining here


@pytest.mark.integration
async def test_sigterm_with_publish_and_watch_streams_open_exits_before_the_grace(
    services: Callable[..., ServiceProcess],
) -> None:
    cm = start_cm(services, "--grace-s", str(GRACE_S))
    rng = random.Random(3)
    engine = ToyEngine("w0", IndexHasher("toy"), seed=0)
    async with grpc.aio.insecure_channel(cm.address) as ch:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        publisher = Publisher(stub, engine)
        assert not (await publisher.hello()).resync_required
        for batch in workload(rng, engine, [[rng.randrange(500) for _ in range(16)]], 3):
            assert not (await publisher.live(batch)).resync_required
        watch = stub.WatchIndex(pb.WatchIndexRequest())
        snapshot = await asyncio.wait_for(watch.read(), 20)
        assert isinstance(snapshot, pb.WatchIndexResponse)  # the follower's stream is open and serving

        cm.proc.send_signal(signal.SIGTERM)
        try:
            exit_code = await asyncio.to_thread(cm.proc.wait, EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"cache-manager still draining {EXIT_WITHIN_S}s after SIGTERM (grace {GRACE_S}s)")

        assert exit_code == 0, cm.log
        assert await asyncio.wait_for(publisher.call.code(), 10) == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (await publisher.call.details() or "")
        assert await asyncio.wait_for(watch.code(), 10) == grpc.StatusCode.OK
