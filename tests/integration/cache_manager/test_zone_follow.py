"""Zone B's cache-manager follows zone A's index through an inter-zone link (`kvmesh.bench.delay_proxy`): a
simulated worker of zone A caches a prompt, B's FindMatches(all_zones) finds it under zone "a"; the link is
cut, A's worker caches more, the link heals, and B catches up by a resumed stream that sent exactly the
deltas it missed (A's watch metrics: no second snapshot). Real processes on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvmesh.bench.delay_proxy import ProxyProcess
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.tokens import accepted_file, provision
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.scrape import metric
from tests.support.sim_worker import BS

pytestmark = pytest.mark.integration
MODEL = "sim-zone-model"
CM_FLAGS = ("--block-size", str(BS), "--model", MODEL, "--checkpoint-interval-s", "0", "--warm-interval-s", "0")


async def until(what: str, cond: Callable[[], Awaitable[bool]], timeout: float = 30) -> None:
    """Bounded poll of another process's eventual state."""
    try:
        async with asyncio.timeout(timeout):
            while not await cond():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


async def generate(address: str, rid: str, prompt: list[int]) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        req = worker_pb2.GenerateRequest(
            request_id=rid, token_ids=common_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(max_tokens=1)
        )
        [_ async for _ in worker_pb2_grpc.WorkerServiceStub(ch).Generate(req, timeout=20)]


class Observer:
    """A direct WatchIndex on zone A (not through the link): how many deltas each of A's revisions carried."""

    def __init__(self, stub: cm_grpc.CacheManagerServiceStub) -> None:
        self.deltas: dict[int, int] = {}
        self.call = stub.WatchIndex(pb.WatchIndexRequest())
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.call:
            if not msg.snapshot:
                self.deltas[msg.revision] = len(msg.deltas)

    def after(self, revision: int) -> int:
        return sum(n for r, n in self.deltas.items() if r > revision)

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_zone_b_follows_zone_a_and_resumes_after_a_partition(services: Callable[..., ServiceProcess]) -> None:
    cm_a = services("cache-manager", *CM_FLAGS, "--zone", "a")
    link = ProxyProcess(cm_a.address, delay_ms=1.0)
    cm_b = services("cache-manager", *CM_FLAGS, "--zone", "b", "--follow-zone", f"a={link.address}")
    worker = services(
        "worker",
        "--engine", "sim", "--model", MODEL, "--block-size", str(BS), "--kv-blocks", "512", "--sim-speed", "0",
        "--zone", "a", "--cache-manager", cm_a.address,
    )  # fmt: skip
    first, second = list(range(10, 10 + 4 * BS)), list(range(5000, 5000 + 6 * BS))
    async with grpc.aio.insecure_channel(cm_a.address) as ch_a, grpc.aio.insecure_channel(cm_b.address) as ch_b:
        a, b = cm_grpc.CacheManagerServiceStub(ch_a), cm_grpc.CacheManagerServiceStub(ch_b)
        observer = Observer(a)
        try:

            async def followed() -> pb.GetStatsResponse.FollowedZone:
                (z,) = (await b.GetStats(pb.GetStatsRequest(), timeout=5)).followed_zones
                return z

            await generate(worker.address, "first", first)
            await until("B finds A's prompt", lambda: found_in_a(b, first))
            z = await followed()
            assert (z.zone, z.address, z.snapshots, z.resumes) == ("a", link.address, 1, 0) and z.blocks >= 4
            snapshots_sent = metric(cm_a.http_port, "kvmesh_cache_watch_streams_total", 'start="snapshot"')
            assert metric(cm_b.http_port, "kvmesh_cache_zone_follow_lag_seconds_count", 'zone="a"') > 0

            link.cut()
            await until("B sees the link down", lambda: followed_down(followed))
            cut_at = (await followed()).revision
            for i in range(3):  # cached in A during the partition: the last one holds `second`
                await generate(worker.address, f"second-{i}", second[: (4 + i) * BS])
            await until("A holds the second prompt", lambda: found_in_a(a, second))
            assert not await found_in_a(b, second)
            resumed_before = metric(cm_a.http_port, "kvmesh_cache_watch_deltas_sent_total", 'part="resumed"')

            link.heal()
            await until("B catches up", lambda: found_in_a(b, second))
            z = await followed()
            assert z.connected and (z.snapshots, z.resumes) == (1, 1)
            await until("the observer saw every revision", lambda: seen(observer, z.revision))
            missed = observer.after(cut_at)
            assert missed > 0
            # no full resend: the resumed stream carried exactly the deltas of the revisions B missed
            assert metric(cm_a.http_port, "kvmesh_cache_watch_streams_total", 'start="snapshot"') == snapshots_sent
            assert metric(cm_a.http_port, "kvmesh_cache_watch_streams_total", 'start="resumed"') == 1
            resumed = metric(cm_a.http_port, "kvmesh_cache_watch_deltas_sent_total", 'part="resumed"')
            assert resumed - resumed_before == missed
            assert await found_in_a(b, first)  # and what it had before is still there
        finally:
            await observer.close()
            link.close()


async def seen(observer: Observer, revision: int) -> bool:
    return max(observer.deltas, default=0) >= revision


async def followed_down(followed: Callable[[], Awaitable[pb.GetStatsResponse.FollowedZone]]) -> bool:
    return not (await followed()).connected


async def test_a_restarted_follower_resumes_from_its_checkpoint(
    services: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    """B checkpoints A's copy with its own index; a restarted B resumes from the checkpointed revision (A's
    journal still holds it): no snapshot, and A's blocks are found before and after."""
    cm_a = services("cache-manager", *CM_FLAGS, "--zone", "a")
    worker = services(
        "worker",
        "--engine", "sim", "--model", MODEL, "--block-size", str(BS), "--kv-blocks", "512", "--sim-speed", "0",
        "--zone", "a", "--cache-manager", cm_a.address,
    )  # fmt: skip
    b_flags = (*CM_FLAGS, "--zone", "b", "--follow-zone", f"a={cm_a.address}", "--checkpoint-dir", str(tmp_path))
    prompt = list(range(10, 10 + 4 * BS))
    await generate(worker.address, "first", prompt)
    cm_b = services("cache-manager", *b_flags)
    async with grpc.aio.insecure_channel(cm_b.address) as ch:
        b = cm_grpc.CacheManagerServiceStub(ch)
        await until("B finds A's prompt", lambda: found_in_a(b, prompt))
        await b.Checkpoint(pb.CheckpointRequest(), timeout=10)
    assert cm_b.terminate(timeout=30) == 0
    cm_b = services("cache-manager", *b_flags)
    async with grpc.aio.insecure_channel(cm_b.address) as ch:
        b = cm_grpc.CacheManagerServiceStub(ch)
        assert await found_in_a(b, prompt)  # from the checkpoint
        await until("B resumes", lambda: resumed_once(b))
        assert metric(cm_a.http_port, "kvmesh_cache_watch_streams_total", 'start="snapshot"') == 1


async def found_in_a(stub: cm_grpc.CacheManagerServiceStub, prompt: list[int]) -> bool:
    req = pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=prompt), model=MODEL, all_zones=True)
    r = await stub.FindMatches(req, timeout=5)
    return any(m.zone == "a" and m.matched_blocks == len(prompt) // BS for m in r.matches)


async def resumed_once(stub: cm_grpc.CacheManagerServiceStub) -> bool:
    (z,) = (await stub.GetStats(pb.GetStatsRequest(), timeout=5)).followed_zones
    assert z.snapshots == 0
    return z.connected and z.resumes == 1


async def test_the_follower_authenticates_as_its_cache_manager(
    services: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    """Zone A enforces the authorisation table; B follows it with its own bearer token (role cache-manager:
    WatchIndex and the GetStats settings check admitted)."""
    files = provision(tmp_path / "auth", [Identity(CallerRole.CACHE_MANAGER, "cm-b", "b")])
    (own,) = files.values()
    accepted = str(accepted_file(tmp_path / "auth"))
    cm_a = services("cache-manager", *CM_FLAGS, "--zone", "a", "--auth-tokens-file", accepted)
    cm_b = services(
        "cache-manager", *CM_FLAGS, "--zone", "b", "--follow-zone", f"a={cm_a.address}", "--auth-token-file", str(own)
    )
    async with grpc.aio.insecure_channel(cm_b.address) as ch:
        b = cm_grpc.CacheManagerServiceStub(ch)

        async def connected() -> bool:
            (z,) = (await b.GetStats(pb.GetStatsRequest(), timeout=5)).followed_zones
            return z.connected and z.snapshots == 1

        await until("B follows the authenticating A", connected)
    async with grpc.aio.insecure_channel(cm_a.address) as ch:  # A does enforce it: anonymous is refused
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await cm_grpc.CacheManagerServiceStub(ch).WatchIndex(pb.WatchIndexRequest()).read()
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
