"""The planner's Kubernetes actuator (kvmesh.services.planner.kubernetes) against the API server stand-in of
tests/support/kube_api (HTTPS on loopback, bearer tokens, RBAC, the ReplicaSet controller's deletion order)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.services.planner.actuators import make_actuator
from kvmesh.services.planner.kubernetes import DELETION_COST, KubeApi, KubeError, KubernetesWorkers
from kvmesh.services.planner.settings import PlannerSettings
from tests.support.certs import make_pki
from tests.support.kube_api import KubeApiStandIn

NS = "serving"
DEP = "kv-zone-a-worker"
LABELS = {"app.kubernetes.io/name": "kvmesh-worker", "kvmesh.io/zone": "zone-a"}
PLANNER_RULES = {
    ("get", "deployments"),
    ("get", "deployments/scale"),
    ("patch", "deployments/scale"),
    ("list", "pods"),
    ("patch", "pods"),
}


@dataclass
class Cluster:
    api: KubeApiStandIn
    ca: Path
    token_file: Path

    def actuator(self, token: str = "planner-token") -> KubernetesWorkers:
        self.token_file.write_text(token + "\n")
        kube = KubeApi(self.api.url, NS, str(self.token_file), str(self.ca))
        return KubernetesWorkers(kube, {"zone-a": DEP}, poll_s=0.01, start_timeout_s=5.0)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    pki = make_pki(tmp_path / "pki")
    tokens = {"planner-token": PLANNER_RULES, "rotated-token": PLANNER_RULES, "reader-token": {("get", "deployments")}}
    api = KubeApiStandIn(NS, tokens, pki.server_cert, pki.server_key)
    api.add_deployment(DEP, LABELS, replicas=3)
    await api.start()
    yield Cluster(api, pki.ca, tmp_path / "token")
    await api.stop()


async def test_scale_out_adds_one_replica_and_returns_the_new_pod(cluster: Cluster) -> None:
    before = {p.name for p in cluster.api.deployments[DEP].pods}
    act = cluster.actuator()
    new = await act.start("zone-a")
    await act.close()
    pods = {p.name for p in cluster.api.deployments[DEP].pods}
    assert cluster.api.deployments[DEP].replicas == 4
    assert pods - before == {new}
    assert ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{DEP}/scale") in cluster.api.requests


async def test_concurrent_scale_outs_return_different_pods(cluster: Cluster) -> None:
    """Both starts patch before the controller creates either pod: each must still get its own."""
    cluster.api.manual_controller = True
    act = cluster.actuator()
    starts = [asyncio.create_task(act.start("zone-a")) for _ in range(2)]
    dep = cluster.api.deployments[DEP]

    async def both_patched() -> None:
        while dep.replicas < 5:
            await cluster.api.scaled.wait()
            cluster.api.scaled.clear()

    await asyncio.wait_for(both_patched(), 10)
    cluster.api.reconcile()
    got = await asyncio.wait_for(asyncio.gather(*starts), 10)
    await act.close()
    assert len(set(got)) == 2 and {p.name for p in dep.pods} >= set(got)


async def test_scale_in_deletes_the_drained_pod_not_the_controllers_default(cluster: Cluster) -> None:
    pods = [p.name for p in cluster.api.deployments[DEP].pods]
    drained = pods[0]  # the oldest: the controller alone would delete the newest
    act = cluster.actuator()
    await act.stop("zone-a", "10.0.0.7:50053", drained)
    await act.close()
    assert cluster.api.deleted == [drained]
    assert cluster.api.deployments[DEP].replicas == 2
    assert all(DELETION_COST not in p.annotations for p in cluster.api.deployments[DEP].pods)


async def test_the_token_is_read_on_every_call(cluster: Cluster) -> None:
    act = cluster.actuator()
    await act.start("zone-a")
    cluster.token_file.write_text("rotated-token")
    del cluster.api.tokens["planner-token"]  # the kubelet rotated the bound token
    await act.start("zone-a")
    await act.close()
    assert cluster.api.deployments[DEP].replicas == 5


async def test_api_errors_name_the_call_and_what_the_server_said(cluster: Cluster) -> None:
    act = cluster.actuator("unknown-token")
    with pytest.raises(KubeError, match="HTTP 401"):
        await act.start("zone-a")
    await act.close()
    act = cluster.actuator("reader-token")
    with pytest.raises(KubeError, match=r'HTTP 403: .*cannot list resource "pods"'):
        await act.start("zone-a")
    await act.close()
    act = KubernetesWorkers(act.api, {"zone-a": "no-such-worker"}, poll_s=0.01)
    cluster.token_file.write_text("planner-token")
    with pytest.raises(KubeError, match=r'HTTP 404: deployments\.apps "no-such-worker" not found'):
        await act.start("zone-a")
    with pytest.raises(InvalidArgument, match="kube_deployments"):
        await act.start("zone-b")
    await act.close()
    assert cluster.api.deployments[DEP].replicas == 3  # nothing was changed by a failed call


def test_settings_are_checked_naming_the_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(InvalidArgument, match="kube_api_url"):
        make_actuator(PlannerSettings(actuator="kubernetes", kube_deployments=("a=w",)))
    token = tmp_path / "t"
    token.write_text("x")
    with pytest.raises(InvalidArgument, match="kube_namespace"):
        KubeApi("https://h:6443", "", str(token))
    with pytest.raises(InvalidArgument, match="kube_token_file"):
        KubeApi("https://h:6443", NS, str(tmp_path / "missing"))
    kube = KubeApi("https://h:6443", NS, str(token))
    for bad in ((), ("a",), ("a=w", "a=v")):
        with pytest.raises(InvalidArgument, match="kube_deployments"):
            make_actuator(
                PlannerSettings(
                    actuator="kubernetes",
                    kube_deployments=bad,
                    kube_api_url="https://h:6443",
                    kube_namespace=NS,
                    kube_token_file=str(token),
                )
            )
    assert kube.namespace == NS
