"""Prefill/decode disaggregation end to end on real processes (router, cache-manager, a prefill and a decode
sim worker with CPU tiers, on 127.0.0.1): a long prompt's prefill half runs on the prefill worker, its KV is
handed to the decode worker over kv-sync, and the client's one stream has the tokens an aggregated run gives;
a short prompt runs aggregated on the decode worker. Faults: the prefill worker SIGKILLed before its handoff
reaches the router (the request runs aggregated), and the prefill worker frozen (SIGSTOP) right after its
handoff left, so the decode worker's pull of it fails by its deadline (the decode worker computes the prompt).
Every request completes with the right tokens, and no hold is left on the prefill worker."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.router.test_e2e import BS, _wait_for_holder, gen, start_router, stream, toks
from tests.support.gate_proxy import GateProxy
from tests.support.poll import wait_until

pytestmark = pytest.mark.integration
SIM = ["--engine", "sim", "--block-size", str(BS), "--kv-blocks", "4096", "--cpu-tier-mb", "8"]
LONG = 40 * BS + 5  # 40 blocks handed over, the last token's block computed by the decode worker


def metric(port: int, name: str, labels: str = "") -> float:
    """One sample of a service's /metrics (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.split()[-1])
    return 0.0


@dataclass
class Fleet:
    router: ServiceProcess
    cache_manager: str
    prefill: ServiceProcess
    decodes: list[ServiceProcess]

    @property
    def decode(self) -> ServiceProcess:
        return self.decodes[0]


def fleet(
    services: Callable[..., ServiceProcess],
    *decode_flags: str,
    decodes: int = 1,
    prefill_address: Callable[[str], str] = lambda a: a,
) -> Fleet:
    """A router over one prefill and `decodes` decode workers, once it sees every worker's role and load."""
    cm = services("cache-manager", "--block-size", str(BS), "--model", "tiny")
    speed = ["--sim-speed", "1", "--cache-manager", cm.address]
    prefill = services("worker", *SIM, *speed, "--role", "prefill")
    decode = [services("worker", *SIM, *speed, "--role", "decode", *decode_flags) for _ in range(decodes)]
    addresses = ",".join([prefill_address(prefill.address), *(d.address for d in decode)])
    router = services(
        "router", "--workers", addresses, "--block-size", str(BS), "--cache-manager", cm.address, "--salt-model", "tiny"
    )
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        listed = lambda: admin.ListWorkers(router_pb2.ListWorkersRequest()).workers  # noqa: E731
        n = decodes + 1
        wait_until(lambda: len(listed()) == n and all(w.endpoint.id and w.load.timestamp for w in listed()))
    return Fleet(router, cm.address, prefill, decode)


def reference(
    services: Callable[..., ServiceProcess],
    prompt: list[int],
    n: int,
    request: router_pb2.RouterServiceGenerateRequest | None = None,
) -> list[int]:
    """The tokens one aggregated sim worker gives (the sim engine is deterministic per prompt, or per seed)."""
    worker = services("worker", *SIM, "--sim-speed", "0")
    router = start_router(services, [worker])
    return [t for m in stream(router.address, request or gen(prompt, n), key=None) for t in m.token_ids]


def seeded(prompt: list[int], n: int) -> router_pb2.RouterServiceGenerateRequest:
    """A request whose sim tokens depend on its seed and position only: a migrated request (prompt + tokens so
    far, elsewhere) continues exactly the sequence an uninterrupted run gives."""
    req = gen(prompt, n)
    req.sampling.seed = 5
    return req


def test_a_long_prompt_is_prefilled_on_one_worker_and_decoded_on_the_other(
    services: Callable[..., ServiceProcess],
) -> None:
    f = fleet(services)
    router, prefill, decode = f.router, f.prefill, f.decode
    prompt = toks(LONG, 7)
    msgs = list(stream(router.address, gen(prompt, 12), key=None, timeout=60))
    assert {m.worker_id for m in msgs if m.token_ids} == {decode_id(decode)}
    assert [t for m in msgs for t in m.token_ids] == reference(services, prompt, 12)
    assert msgs[-1].usage.prompt_tokens == LONG and msgs[-1].usage.cached_tokens == 0  # nothing was cached before
    assert msgs[-1].migrations == 0
    assert metric(router.http_port, "kvmesh_pd_decisions_total", '{mode="disaggregated",reason="disaggregate"}') == 1
    assert metric(router.http_port, "kvmesh_handoff_blocks_total") == 40
    assert metric(decode.http_port, "kvmesh_worker_kv_pull_hints_total", '{pulled="true"}') == 1
    _wait_for_holder(f.cache_manager, prompt, decode_id(decode), blocks=40)  # the handed-over blocks are indexed
    # the same prompt again: the decode worker holds it now, so little is left to prefill: aggregated there
    again = list(stream(router.address, gen(prompt, 12), key=None, timeout=60))
    assert {m.worker_id for m in again if m.token_ids} == {decode_id(decode)}
    assert again[-1].usage.cached_tokens == 40 * BS
    short = list(stream(router.address, gen(toks(3 * BS, 500), 4), key=None))
    assert {m.worker_id for m in short if m.token_ids} == {decode_id(decode)}
    assert metric(router.http_port, "kvmesh_pd_decisions_total", '{mode="aggregated",reason="short-prefill"}') == 2
    # the OpenAI API takes the same path: one response, usage right
    fresh = toks(LONG, 900)
    r = httpx.post(
        f"http://127.0.0.1:{router.http_port}/v1/completions",
        json={"prompt": fresh, "max_tokens": 12, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == LONG and body["usage"]["completion_tokens"] == 12
    assert metric(router.http_port, "kvmesh_pd_decisions_total", '{mode="disaggregated",reason="disaggregate"}') == 2
    wait_until(lambda: metric(prefill.http_port, "kvmesh_worker_handoff_holds") == 0, timeout_s=30)


def decode_id(decode: ServiceProcess) -> str:
    with grpc.insecure_channel(decode.address) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10).worker_id


def _any_message(_: bytes) -> bool:
    return True


def test_a_prefill_worker_killed_before_its_handoff_leaves_the_request_aggregated(
    services: Callable[..., ServiceProcess],
) -> None:
    """The prefill worker sits behind a `GateProxy` that holds back its first message on the next call (the
    prefill half's handoff): it is SIGKILLed while the router still waits for it."""
    gates: list[GateProxy] = []

    def gated(address: str) -> str:
        gates.append(GateProxy(address, _any_message, hold_chosen=True))
        return gates[0].address

    f = fleet(services, prefill_address=gated)
    router, prefill, decode = f.router, f.prefill, f.decode
    gate = gates[0]
    try:
        gate.arm()
        prompt = toks(LONG, 11)
        with grpc.insecure_channel(router.address) as ch:
            call = router_pb2_grpc.RouterServiceStub(ch).Generate(gen(prompt, 10), timeout=60)
            assert gate.stalled.wait(30)  # the prefill half's handoff is held: the router has not seen it
            prefill.kill()
            msgs = list(call)
    finally:
        gate.close()
    assert [t for m in msgs for t in m.token_ids] == reference(services, prompt, 10)
    assert {m.worker_id for m in msgs if m.token_ids} == {decode_id(decode)}
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert metric(router.http_port, "kvmesh_handoff_fallbacks_total", '{cause="prefill_failed"}') == 1


def test_a_handoff_whose_source_freezes_is_computed_by_the_decode_worker(
    services: Callable[..., ServiceProcess],
) -> None:
    """The prefill worker is SIGSTOPped the moment its handoff leaves it (the gate's check sees the message):
    the decode worker's pull of the held blocks gets no answer and ends at its deadline; it computes them."""
    frozen: list[int] = []
    pids: list[int] = []

    def freeze(_: bytes) -> bool:
        if pids and not frozen:
            os.kill(pids[0], signal.SIGSTOP)
            frozen.append(pids[0])
        return False  # forwarded: the router gets the handoff and sends the decode half

    gates: list[GateProxy] = []

    def gated(address: str) -> str:
        gates.append(GateProxy(address, freeze))
        return gates[0].address

    f = fleet(services, "--pull-timeout-ms", "1500", prefill_address=gated)
    router, prefill, decode = f.router, f.prefill, f.decode
    pids.append(prefill.proc.pid)
    gate = gates[0]
    try:
        gate.arm()
        prompt = toks(LONG, 13)
        msgs = list(stream(router.address, gen(prompt, 10), key=None, timeout=60))
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        gate.close()
    assert frozen
    assert [t for m in msgs for t in m.token_ids] == reference(services, prompt, 10)
    assert metric(router.http_port, "kvmesh_pd_decisions_total", '{mode="disaggregated",reason="disaggregate"}') == 1
    assert metric(decode.http_port, "kvmesh_worker_kv_pull_hints_total", '{pulled="false"}') == 1
    wait_until(lambda: metric(prefill.http_port, "kvmesh_worker_handoff_holds") == 0, timeout_s=30)


def test_a_decode_worker_killed_mid_stream_hands_the_request_to_another(
    services: Callable[..., ServiceProcess],
) -> None:
    """A disaggregated request's decode worker is SIGKILLed after the client got tokens: the router migrates it
    (prompt + tokens so far) to the other decode worker, and the client's one stream is whole and right."""
    f = fleet(services, decodes=2)
    prompt = toks(LONG, 17)
    got: list[int] = []
    msgs = []
    killed = ""
    ids = {decode_id(d): d for d in f.decodes}
    for m in stream(f.router.address, seeded(prompt, 60), key=None, timeout=60):
        msgs.append(m)
        got += m.token_ids
        if len(got) >= 10 and not killed:
            killed = m.worker_id
            ids[killed].kill()
    assert killed in ids
    assert got == reference(services, prompt, 150, seeded(prompt, 60))
    assert msgs[-1].migrations == 1
    assert {m.worker_id for m in msgs[-3:]} == set(ids) - {killed}
