"""deploy/helm/kvmesh with prefill/decode pools (`worker.prefillReplicas` / `worker.decodeReplicas`, per zone in
`zones[].worker`), rendered by the real Helm library as tests/integration/deploy/test_helm_chart.py renders the
chart's defaults and examples, whose network-policy and identity checks run on this render too:

- a disaggregated zone has two worker Deployments, decode (<full>) and prefill (<full>-prefill), their selectors
  told apart by kvmesh.io/worker-role, each pod told its role (and its node as its host label, a prefill worker
  its CPU tier) in settings the worker's own loader accepts; an aggregated zone beside it stays as it was;
- the zone's worker Services, disruption budget and NetworkPolicy cover both pools' pods;
- the zone's planner sizes the pools (KVMESH_POOLS) and scales only the decode Deployment (the prefill one
  keeps its replicas);
- prefill workers without decode workers, a negative count or an unknown key are refused, naming the field.
"""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvmesh.core.config import load_settings
from kvmesh.services.worker.settings import WorkerSettings
from tests.integration.deploy import test_helm_chart as chart_checks
from tests.support.helm_render import KUBE_VERSION, render

pytestmark = pytest.mark.integration

CHART = chart_checks.CHART
USER = {
    **chart_checks.NO_DEPS,
    "zones": [{"name": "zone-a", "worker": {"prefillReplicas": 2, "decodeReplicas": 3}}, {"name": "zone-b"}],
    "planner": {"enabled": True},
    "tls": {"enabled": True},
}


@pytest.fixture(scope="module")
def rendered() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = chart_checks._merge(yaml.safe_load((CHART / "values.yaml").read_text()), USER)
    return values, render(CHART, copy.deepcopy(USER))["manifests"]


def _workers(manifests: list[dict[str, Any]], zone: str) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d
        for d in manifests
        if d["kind"] == "Deployment" and chart_checks._component(d) == (zone, "worker")
    }


def _env(d: dict[str, Any]) -> dict[str, str]:
    refs = {"metadata.name": f"{d['metadata']['name']}-7d9f-x2b4c", "metadata.namespace": "prod", "spec.nodeName": "n1"}
    env: dict[str, str] = {}
    for e in d["spec"]["template"]["spec"]["containers"][0]["env"]:
        value = refs[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e else e["value"]
        env[e["name"]] = chart_checks._expand(value, env)
    return env


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_a_disaggregated_zone_has_a_deployment_per_role(rendered: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    _, manifests = rendered
    for m in manifests:
        if m["apiVersion"] != "cert-manager.io/v1":
            kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
    pools = _workers(manifests, "zone-a")
    decode, prefill = pools["kvmesh-zone-a-worker"], pools["kvmesh-zone-a-worker-prefill"]
    assert set(pools) == {"kvmesh-zone-a-worker", "kvmesh-zone-a-worker-prefill"}
    assert "replicas" not in decode["spec"] and prefill["spec"]["replicas"] == 2  # the planner owns decode's count
    roles = {}
    for d in (decode, prefill):
        env = _env(d)
        settings = load_settings(WorkerSettings, argv=[], env=env, service="worker")
        roles[d["metadata"]["name"]] = (settings.worker_role.value, settings.host_label, settings.cpu_tier_mb)
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert labels["kvmesh.io/worker-role"] == settings.role
        other = prefill if d is decode else decode
        assert not _selects(d["spec"]["selector"]["matchLabels"], other["spec"]["template"]["metadata"]["labels"])
    assert roles == {
        "kvmesh-zone-a-worker": ("decode", "n1", 16.0),
        "kvmesh-zone-a-worker-prefill": ("prefill", "n1", 8192.0),
    }
    (aggregated,) = _workers(manifests, "zone-b").values()
    assert "kvmesh.io/worker-role" not in aggregated["spec"]["selector"]["matchLabels"]  # as before pools existed
    assert _env(aggregated)["KVMESH_ROLE"] == "both" and "KVMESH_HOST_LABEL" not in _env(aggregated)


def test_the_zones_services_budget_and_policy_cover_both_pools(
    rendered: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    _, manifests = rendered
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in _workers(manifests, "zone-a").values()]
    kinds = ("Service", "PodDisruptionBudget", "NetworkPolicy")
    covering = [m for m in manifests if m["kind"] in kinds and chart_checks._component(m) == ("zone-a", "worker")]
    selectors = {
        (m["kind"], m["metadata"]["name"]): m["spec"].get("podSelector", {}).get("matchLabels")
        or m["spec"]["selector"].get("matchLabels")
        or m["spec"]["selector"]
        for m in covering
    }
    assert len(selectors) == 4  # the Service, the headless Service, the budget, the NetworkPolicy
    assert all(_selects(sel, labels) for sel in selectors.values() for labels in pods), selectors
    # each prefill pod's advertised DNS name is under a headless Service that selects it
    prefill = _workers(manifests, "zone-a")["kvmesh-zone-a-worker-prefill"]
    assert prefill["spec"]["template"]["spec"]["subdomain"] == "kvmesh-zone-a-worker-pods"
    assert ("Service", "kvmesh-zone-a-worker-pods") in selectors


def test_network_policies_and_identities_hold_with_pools(
    rendered: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    values, manifests = rendered
    chart_checks.test_network_policies_allow_exactly_the_calls_made(rendered)
    # the identity checks assume a Deployment per Service; the prefill pods are the worker Service's too, so
    # they get the decode pods' certificate request (SANs: that Service's names and the pod's own) and address
    pools = _workers(manifests, "zone-a")
    prefill = pools.pop("kvmesh-zone-a-worker-prefill")
    chart_checks.test_tls_identities_from_cert_manager((values, [m for m in manifests if m is not prefill]))
    (decode,) = pools.values()

    def tls_and_address(d: dict[str, Any]) -> tuple[Any, str]:
        vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        return vols["tls"], env["KVMESH_ADVERTISE_ADDRESS"]

    assert tls_and_address(prefill) == tls_and_address(decode)


def test_the_planner_sizes_the_pools_of_a_disaggregated_zone_only(
    rendered: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    _, manifests = rendered
    planners = {
        chart_checks._component(d)[0]: _env(d)
        for d in manifests
        if d["kind"] == "Deployment" and chart_checks._component(d)[1] == "planner"
    }
    assert planners["zone-a"]["KVMESH_POOLS"] == "true" and "KVMESH_POOLS" not in planners["zone-b"]
    assert planners["zone-a"]["KVMESH_KUBE_DEPLOYMENTS"] == "zone-a=kvmesh-zone-a-worker"  # the decode pool


@pytest.mark.parametrize(
    ("zone_worker", "message"),
    [
        ({"prefillReplicas": 2}, r"zones\[zone-a\]\.worker: 2 prefill workers and no decode worker"),
        ({"prefillReplicas": -1, "decodeReplicas": 1}, r"zones\[zone-a\]\.worker\.prefillReplicas: must be >= 0"),
        ({"prefill": 1}, r"zones\[zone-a\]\.worker\.prefill: unknown key"),
    ],
)
def test_bad_pools_are_refused_naming_the_field(zone_worker: dict[str, int], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        render(CHART, {**chart_checks.NO_DEPS, "zones": [{"name": "zone-a", "worker": zone_worker}]})
