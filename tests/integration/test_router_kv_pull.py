"""The router hints a pull, end to end (real router, cache-manager and two sim workers with CPU tiers on
127.0.0.1): the worker holding a long prefix is drained, the next request with that prefix goes to the other
worker with a pull hint, which pulls the prefix from the drained one's tier: cached tokens, the same output."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from kvmesh.launcher import ServiceProcess
from kvmesh.v1 import router_pb2, router_pb2_grpc
from tests.integration.test_router_e2e import BS, _wait_for_holder, gen, start_router, stream, toks

pytestmark = pytest.mark.integration


def test_a_drained_holder_s_prefix_is_pulled_by_the_other_worker(services: Callable[..., ServiceProcess]) -> None:
    cm = services("cache-manager", "--block-size", str(BS), "--model", "tiny")
    flags = ["--engine", "sim", "--block-size", str(BS), "--kv-blocks", "4096", "--sim-speed", "0"]
    workers = [services("worker", *flags, "--cpu-tier-mb", "8", "--cache-manager", cm.address) for _ in range(2)]
    router = start_router(services, workers, "--cache-manager", cm.address, "--salt-model", "tiny")
    prompt = toks(40 * BS, 100)
    first = list(stream(router.address, gen(prompt, 6), key=None))
    home = first[-1].worker_id
    _wait_for_holder(cm.address, prompt, home, blocks=40)
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=home, drain=True))
    second = list(stream(router.address, gen(prompt, 6), key=None))
    assert second[-1].worker_id != home
    assert second[-1].usage.cached_tokens == 39 * BS  # every block but the last token's, pulled from `home`
    assert [t for m in second for t in m.token_ids] == [t for m in first for t in m.token_ids]
