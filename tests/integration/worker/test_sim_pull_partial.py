"""The simulated engine's peer pull over real gRPC (`PeerPulls`, loopback), the source's stream dying or a
block corrupt part-way: the engine keeps exactly the leading blocks that arrived verified, computes the
rest, and answers with the same tokens."""

from __future__ import annotations

import os
import time
import uuid

import grpc
import pytest

from kvmesh.core.generation import EngineOutput, EngineRequest, SamplingParams
from kvmesh.core.pull import KvPull
from kvmesh.engine.clock import VirtualClock
from kvmesh.engine.sim.core import SimConfig
from kvmesh.engine.sim.driver import SimEngine
from kvmesh.engine.sim.tiers import HostTiers, block_payload, sim_layout, tiny_block_bytes
from kvmesh.kvplane.kvsync.peer import BreakingKvSync
from kvmesh.kvplane.kvsync.service import add_to_server
from kvmesh.kvplane.kvsync.tier import TierRegion
from kvmesh.kvplane.pulls import PeerPulls
from kvmesh.services.worker.kvpull import peer_pulls
from kvmesh.services.worker.settings import WorkerSettings

pytestmark = pytest.mark.integration
BS = 16
BB = tiny_block_bytes(BS)
LAYOUT = sim_layout("m", BS, BB)
PROMPT = tuple(range(1, 1 + 10 * BS + 5))  # 10 full blocks a pull can bring


def _engine(pulls: PeerPulls | None) -> SimEngine:
    region = TierRegion.create(f"kvmesh-it-sim-{uuid.uuid4().hex[:12]}", BB, 64, LAYOUT)
    tiers = HostTiers(region, None, LAYOUT, lease_clock_ns=time.monotonic_ns)
    return SimEngine(SimConfig(block_size=BS, num_blocks=256), clock=VirtualClock(), tiers=tiers, pull_transport=pulls)


def _req(rid: str) -> EngineRequest:
    return EngineRequest(rid, PROMPT, sampling=SamplingParams(max_tokens=4, temperature=0.0))


async def _generate(eng: SimEngine, rid: str) -> tuple[list[int], int]:
    outs: list[EngineOutput] = [o async for o in eng.generate(_req(rid))]
    assert outs[-1].usage is not None
    return [t for o in outs for t in o.token_ids], outs[-1].usage.cached_tokens


@pytest.mark.parametrize("case", ["dies_after_6", "corrupt_at_3", "whole"])
async def test_sim_pull_keeps_exactly_the_verified_leading_blocks(case: str) -> None:
    source = TierRegion.create(f"kvmesh-it-src-{os.getpid()}-{os.urandom(4).hex()}", BB, 64, LAYOUT)
    servicer = BreakingKvSync({"cpu": source}, message_bytes=BB)
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pulls = peer_pulls(WorkerSettings(pull_over_shm=False, pull_timeout_ms=5000))
    eng, ref = _engine(pulls), _engine(None)
    await eng.start()
    await ref.start()
    try:
        digests = [d for d, _ in eng.core.prefix_blocks(_req("a"))]
        assert len(digests) == 10
        for i, d in enumerate(digests):
            data = bytearray(block_payload(d, BB))
            if case == "corrupt_at_3" and i == 3:
                data[BB // 2] ^= 1  # stored with the CRC of the corrupted bytes, then flipped back below
            assert source.put(d, bytes(data), time.monotonic_ns())
        if case == "corrupt_at_3":
            view = source.get(digests[3], time.monotonic_ns())
            assert view is not None
            view[BB // 2] ^= 1  # the right bytes now, under the wrong CRC: the puller's check fails
            del view
        if case == "dies_after_6":
            servicer.messages = 6
        want = {"dies_after_6": 6, "corrupt_at_3": 3, "whole": 10}[case]
        hint = KvPull(source_address=f"127.0.0.1:{port}", region="cpu", num_blocks=10, timeout_ms=5000)
        assert (await eng.pull_prefix(_req("a"), hint)).blocks == want
        assert eng.pulls["partial"] == (want < 10) and eng.pulls["corrupt"] == 0
        assert eng.core.tiers is not None and eng.core.tiers.prefix_run(digests) == want  # nothing after
        toks, cached = await _generate(eng, "a")
        assert cached == want * BS and toks == (await _generate(ref, "a"))[0]
    finally:
        await eng.stop()
        await ref.stop()
        await pulls.close()
        await server.stop(None)
        source.close()
