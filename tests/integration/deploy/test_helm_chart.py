"""deploy/helm/kvmesh rendered by the real Helm library (helm-sdkpy's Helm v4), every manifest schema-checked.

Rendered for the chart's defaults and for every file in deploy/helm/kvmesh/examples/ (tests/support/helm_render
says how: Helm's install action against a recording stand-in for the Kubernetes API, no cluster). Consul and
Redis are declared dependencies that cannot be fetched here (no chart repository is reachable): the chart
refuses to render with an enabled dependency missing from charts/, which is asserted, and every other render
disables both (`NO_DEPS`) unless the example already points at external ones. Then, per render:
- every manifest is valid for Kubernetes `KUBE_VERSION` (kubernetes-validate, strict: unknown fields fail);
  cert-manager's Issuer has no schema there and is checked field by field;
- GPU workers request and limit `nvidia.com/gpu` and tolerate the GPU taint; nothing else does; the same GPU
  count and the GPU-hour price reach the worker's settings (the cost rules' inputs);
- readiness, liveness (and the worker's startup) probes are gRPC probes of the container's gRPC port, or with
  TLS (the kubelet's gRPC probes speak no TLS) GET /healthz on its plain HTTP port;
- a PodDisruptionBudget per zone and component selects exactly its Deployment's pods and keeps one serving;
- the NetworkPolicies admit exactly the calls derived from the authorisation table (kvmesh.security.authz)
  plus the failover service's health probes (DESIGN.md §2), each edge allowed on both ends;
- with TLS, every pod gets a cert-manager CSI certificate whose URI SAN kvmesh.security.identity parses to the
  component's role and zone, with the pod name as id (= KVMESH_SERVICE_ID), and whose DNS SANs hold every name
  peers dial (the Service's, and the pod's own under its headless Service: the address it advertises);
- every KVMESH_* variable is a settings field, and the services' own settings loader accepts the values;
- with planner.enabled, a planner per zone whose Role allows exactly the Kubernetes calls of its actuator on
  its own zone's worker Deployment (whose replica count it then owns), under its own ServiceAccount (no other
  pod mounts a token), pointed at its zone's router and worker Deployment by name.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvmesh.core.config import load_settings
from kvmesh.security.authz import GRPC_RULES, HTTP_RULES
from kvmesh.security.identity import CallerRole, parse_spiffe_id
from kvmesh.services.worker.generate_frames import GENERATE_STREAM_METHOD as GENERATE_FRAMES_AUTHORISED_AS
from tests.support.helm_render import KUBE_VERSION, render

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "deploy/helm/kvmesh"
NO_DEPS = {
    "consul": {"enabled": False, "url": "http://consul.example:8500"},
    "redis": {"enabled": False, "url": "redis://redis.example:6379/0"},
}
COMPONENTS = {
    "router": "router",
    "cache-manager": "cacheManager",
    "worker": "worker",
    "failover": "failover",
    "planner": "planner",  # with planner.enabled
}
GPU = "nvidia.com/gpu"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _cases() -> dict[str, dict[str, Any]]:
    cases = {"defaults": dict(NO_DEPS)}
    for path in sorted((CHART / "examples").glob("*.yaml")):
        values = yaml.safe_load(path.read_text())
        cases[path.stem] = {**{k: v for k, v in NO_DEPS.items() if k not in values}, **values}
    return cases


CASES = _cases()


@pytest.fixture(scope="module", params=sorted(CASES))
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(effective values, manifests) of one case."""
    user = CASES[request.param]
    values = _merge(yaml.safe_load((CHART / "values.yaml").read_text()), user)
    out = render(CHART, user)
    assert len(out["created"]) == len(out["manifests"]) > 0  # Helm built and sent every object
    return values, out["manifests"]


def _components(values: dict[str, Any]) -> list[str]:
    return [c for c in COMPONENTS if c != "planner" or values["planner"]["enabled"]]


def _of(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def _component(obj: dict[str, Any]) -> tuple[str, str]:
    labels = obj["metadata"]["labels"]
    return labels["kvmesh.io/zone"], labels["app.kubernetes.io/name"].removeprefix("kvmesh-")


def test_dependencies_declared_and_refused_when_missing() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    deps = {d["name"]: d for d in chart["dependencies"]}
    assert set(deps) == {"consul", "redis"}
    assert all(deps[n]["condition"] == f"{n}.enabled" and deps[n]["repository"] for n in deps)
    assert not (CHART / "charts").exists(), "this test assumes the dependencies are not vendored"
    with pytest.raises(RuntimeError, match=r"consul\.enabled but the consul chart is not in charts/"):
        render(CHART, {})


def test_names_longer_than_a_pod_hostname_allows_are_refused() -> None:
    with pytest.raises(RuntimeError, match="release and zone names too long"):
        render(CHART, {**NO_DEPS, "zones": [{"name": "a-zone-name-long-enough-to-overflow-63"}]})


def test_router_processes_are_each_scraped_on_a_declared_port(
    rendered: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    """router.processes > 1: the pod runs `--processes N` with process i's /metrics on processMetricsPort + i,
    declares those ports and admits the metrics scrapers to them, is not annotated for a scrape of the shared
    port (which would read whichever process the kernel picks) and mounts a memory-backed /dev/shm for the shared
    index replica; with one process, none of that."""
    values, manifests = rendered
    want = _process_ports(values)
    n = values["router"]["processes"]
    policies = {_component(p): p for p in _of(manifests, "NetworkPolicy")}
    for d in _of(manifests, "Deployment"):
        zone, name = _component(d)
        if name != "router":
            continue
        pod = d["spec"]["template"]
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        declared = {p["containerPort"]: p["name"] for p in container["ports"] if p["name"].startswith("metrics-")}
        assert declared == want
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == ("false" if want else "true")
        shm = [v for v in pod["spec"]["volumes"] if v["name"] == "shared-index"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        if want:
            assert (env["KVMESH_PROCESSES"], env["KVMESH_PROCESS_HTTP_PORT"]) == (str(n), str(min(want)))
            # the processes' shared index replica lives in /dev/shm: memory-backed, sized by the values
            assert mounts["/dev/shm"] == "shared-index"
            assert shm[0]["emptyDir"] == {"medium": "Memory", "sizeLimit": values["router"]["sharedIndexSizeLimit"]}
        else:
            assert "KVMESH_PROCESSES" not in env and "KVMESH_PROCESS_HTTP_PORT" not in env
            assert not shm and "/dev/shm" not in mounts
        metrics_rules = [
            r
            for r in policies[(zone, name)]["spec"]["ingress"]
            if r.get("from") == values["networkPolicy"]["metricsFrom"]
        ]
        assert len(metrics_rules) == 1
        assert {p["port"] for p in metrics_rules[0]["ports"]} == {values["router"]["httpPort"], *want}


def test_each_zones_cache_manager_follows_and_replicates_into_every_other_zone(
    rendered: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    """Several zones (active-active, docs/zones.md): each cache-manager follows every other zone's
    cache-manager at its Service (a name that exists, on its gRPC port) and replicates into it at
    cacheManager.replicationBytesPerS; a single zone follows nothing."""
    values, manifests = rendered
    services = {m["metadata"]["name"]: m for m in _of(manifests, "Service")}
    zones = [z["name"] for z in values["zones"]]
    for d in _of(manifests, "Deployment"):
        zone, name = _component(d)
        if name != "cache-manager":
            continue
        env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        if len(zones) == 1:
            assert "KVMESH_FOLLOW_ZONE" not in env and "KVMESH_REPLICATION_BYTES_PER_S" not in env
            continue
        followed = dict(item.split("=", 1) for item in env["KVMESH_FOLLOW_ZONE"].split(","))
        assert sorted(followed) == sorted(z for z in zones if z != zone)
        for other, address in followed.items():
            host, port = address.rsplit(":", 1)
            assert _component(services[host]) == (other, "cache-manager")
            assert int(port) == values["cacheManager"]["grpcPort"]
        assert float(env["KVMESH_REPLICATION_BYTES_PER_S"]) == values["cacheManager"]["replicationBytesPerS"]


def test_router_processes_below_one_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"router\.processes: must be >= 1"):
        render(CHART, {**NO_DEPS, "router": {"processes": 0}})


def test_every_manifest_is_schema_valid(rendered: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    values, manifests = rendered
    for m in manifests:
        if m["apiVersion"] == "cert-manager.io/v1":
            assert (
                m["kind"] in ("Issuer", "ClusterIssuer") and m["spec"]["ca"]["secretName"] == values["tls"]["caSecret"]
            )
            continue
        kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
    zones = [z["name"] for z in values["zones"]]
    want = {(z, c) for z in zones for c in _components(values)}
    for kind in ("Deployment", "PodDisruptionBudget", "NetworkPolicy"):
        assert sorted(_component(m) for m in _of(manifests, kind)) == sorted(want), kind
    services = _of(manifests, "Service")  # per component: its ClusterIP Service and the headless <name>-pods
    assert sorted(_component(m) for m in services if m["spec"].get("clusterIP") != "None") == sorted(want)
    assert sorted(_component(m) for m in services if m["spec"].get("clusterIP") == "None") == sorted(want)


def test_gpu_workers_and_grpc_probes(rendered: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    values, manifests = rendered
    for d in _of(manifests, "Deployment"):
        zone, name = _component(d)
        pod = d["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        res = container["resources"]
        taint_ok = [t for t in pod.get("tolerations", []) if t["key"] == GPU and t["effect"] == "NoSchedule"]
        if name == "worker":
            n = values["worker"]["gpusPerWorker"]
            assert res["limits"][GPU] == res["requests"][GPU] == n, d["metadata"]["name"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["KVMESH_GPUS"] == str(n)  # what the cost rules bill the pod for
            assert env["KVMESH_GPU_HOUR_PRICE"] == str(values["worker"]["gpuHourPrice"])
            assert taint_ok and pod["nodeSelector"]["kvmesh.io/pool"] == "gpu"
        else:
            assert GPU not in res.get("limits", {}) and GPU not in res.get("requests", {}) and not taint_ok
        zone_selector = next(z for z in values["zones"] if z["name"] == zone).get("nodeSelector") or {}
        assert zone_selector.items() <= pod.get("nodeSelector", {}).items()
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        probes = [k for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in container]
        assert {"readinessProbe", "livenessProbe"} <= set(probes)
        http_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
        for probe in probes:
            handler = set(container[probe]) - {"periodSeconds", "failureThreshold"}
            if values["tls"]["enabled"]:  # the kubelet's gRPC probes speak no TLS: /healthz, HTTPS on the HTTP port
                get = {"path": "/healthz", "port": http_port, "scheme": "HTTPS"}
                assert handler == {"httpGet"} and container[probe]["httpGet"] == get
            else:
                assert handler == {"grpc"} and container[probe]["grpc"]["port"] == grpc_port, probe
        env = {e["name"]: e for e in container["env"]}
        assert env["KVMESH_ZONE"]["value"] == zone and env["KVMESH_PORT"]["value"] == str(grpc_port)
        assert env["KVMESH_SERVICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_generate_frames_are_opened_only_where_opted_in(rendered: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    """Routers reach workers on gRPC unless router.workerTransport is frames (opaque to a service mesh): only then
    do the workers listen on, and their pods and Services expose, the frames port."""
    values, manifests = rendered
    transport = values["router"]["workerTransport"]
    frames = transport == "frames"
    for d in _of(manifests, "Deployment"):
        _, name = _component(d)
        (container,) = d["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if name == "router":
            assert env["KVMESH_WORKER_TRANSPORT"] == transport
        elif name == "worker":
            assert env["KVMESH_FRAMES_PORT"] == (str(values["worker"]["framesPort"]) if frames else "-1")
            assert ("frames" in {p["name"] for p in container["ports"]}) == frames
    for zone in values["zones"]:
        services = [s for s in _of(manifests, "Service") if _component(s) == (zone["name"], "worker")]
        assert ("frames" in {p["name"] for s in services for p in s["spec"]["ports"]}) == frames


def test_disruption_budgets_keep_each_zone_serving(rendered: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    _, manifests = rendered
    deployments = {_component(d): d for d in _of(manifests, "Deployment")}
    for pdb in _of(manifests, "PodDisruptionBudget"):
        d = deployments[_component(pdb)]
        assert pdb["spec"]["selector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
        replicas, spec = d["spec"].get("replicas", 1), pdb["spec"]
        assert ("minAvailable" in spec) != ("maxUnavailable" in spec)
        if replicas > 1:
            assert spec.get("minAvailable", 1) >= 1 and spec.get("maxUnavailable", 0) < replicas, _component(pdb)


# --- NetworkPolicies against the authorisation table ---------------------------------------------------------

_SERVICE_OF_PREFIX = {
    "/kvmesh.v1.CacheManagerService/": ("cache-manager", "grpc"),
    "/kvmesh.v1.FailoverService/": ("failover", "grpc"),
    "/kvmesh.v1.RouterService/": ("router", "grpc"),
    "/kvmesh.v1.RouterAdminService/": ("router", "grpc"),
    "/kvmesh.v1.WorkerService/": ("worker", "grpc"),
    "/kvmesh.v1.KvSyncService/": ("worker", "kvsync"),
}
# roles that are pods of this chart; peer-zone is a worker of another zone (kv-sync)
_COMPONENT_OF_ROLE = {
    CallerRole.ROUTER: "router",
    CallerRole.WORKER: "worker",
    CallerRole.CACHE_MANAGER: "cache-manager",
    CallerRole.FAILOVER: "failover",
    CallerRole.PEER_ZONE: "worker",
    CallerRole.PLANNER: "planner",
}


def _expected_edges(components: list[str], frames: bool) -> set[tuple[str, str, str]]:
    """(caller, callee, port) between the chart's components: the service roles each non-open rule of the
    authorisation table allows, plus the failover service's grpc.health.v1 probes of every service it finds
    in Consul, i.e. all but the planner (health, like the client APIs, is open to anyone in the table, so it
    names no caller); with `frames` (router.workerTransport), GenerateStream's callers on the frames port too."""
    edges = {("failover", c, "grpc") for c in components if c != "planner"}
    for method, rule in GRPC_RULES.items():
        prefix = next((p for p in _SERVICE_OF_PREFIX if method.startswith(p)), None)
        if prefix is None or rule.open:
            continue  # grpc's own health / reflection services; open rules name no caller (the client APIs)
        callee, port = _SERVICE_OF_PREFIX[prefix]
        edges |= {(_COMPONENT_OF_ROLE[r], callee, port) for r in rule.roles if r in _COMPONENT_OF_ROLE}
        if frames and method == GENERATE_FRAMES_AUTHORISED_AS:  # GenerateStream on the worker's frames port
            edges |= {(_COMPONENT_OF_ROLE[r], "worker", "frames") for r in rule.roles if r in _COMPONENT_OF_ROLE}
    for (service, _method, _path), rule in HTTP_RULES.items():
        if service in COMPONENTS and not rule.open:
            edges |= {(_COMPONENT_OF_ROLE[r], service, "http") for r in rule.roles if r in _COMPONENT_OF_ROLE}
    return {e for e in edges if e[0] in components and e[1] in components}


def _port_names(values: dict[str, Any], name: str) -> dict[int, str]:
    v = values[COMPONENTS[name]]
    own = {v["grpcPort"]: "grpc", v["httpPort"]: "http"}
    own |= {v[key]: port for key, port in (("kvsyncPort", "kvsync"), ("framesPort", "frames")) if key in v}
    return own | (_process_ports(values) if name == "router" else {})


def _process_ports(values: dict[str, Any]) -> dict[int, str]:
    """The router's per-process /metrics ports (router.processes > 1): processMetricsPort + i → metrics-i."""
    r = values["router"]
    n = r["processes"]
    return {r["processMetricsPort"] + i: f"metrics-{i}" for i in range(n)} if n > 1 else {}


def _peer(p: dict[str, Any]) -> tuple[str, str | None] | None:
    labels = p.get("podSelector", {}).get("matchLabels", {})
    name = labels.get("app.kubernetes.io/name", "")
    return (name.removeprefix("kvmesh-"), labels.get("kvmesh.io/zone")) if name.startswith("kvmesh-") else None


def test_network_policies_allow_exactly_the_calls_made(rendered: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    values, manifests = rendered
    np = values["networkPolicy"]
    ingress: set[tuple[str, str, str]] = set()
    egress: set[tuple[str, str, str]] = set()
    for pol in _of(manifests, "NetworkPolicy"):
        zone, name = _component(pol)
        assert pol["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert pol["spec"]["podSelector"]["matchLabels"]["kvmesh.io/zone"] == zone
        for rule in pol["spec"]["ingress"]:
            ports = {_port_names(values, name)[p["port"]] for p in rule["ports"]}
            if "from" not in rule:  # from anywhere: only the client APIs, only when clientsFrom is empty
                assert not np["clientsFrom"] and name in ("router", "failover"), (name, rule)
                assert ports == ({"grpc", "http"} if name == "router" else {"grpc"})
                continue
            for peer in filter(None, map(_peer, rule["from"])):
                caller, peer_zone = peer
                assert peer_zone in (zone, None)
                if caller == "router":
                    assert peer_zone == zone, "a router calls only services of its own zone"
                ingress |= {(caller, name, port) for port in ports}
        for rule in pol["spec"]["egress"]:
            for peer in filter(None, map(_peer, rule["to"])):
                callee, _ = peer
                egress |= {(name, callee, _port_names(values, callee)[p["port"]]) for p in rule["ports"]}
    assert ingress == _expected_edges(_components(values), values["router"]["workerTransport"] == "frames")
    assert egress == ingress


def test_tls_identities_from_cert_manager(rendered: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    values, manifests = rendered
    tls = values["tls"]
    issuers = [m for m in manifests if m["apiVersion"] == "cert-manager.io/v1"]
    assert len(issuers) == (1 if tls["enabled"] and tls["createCaIssuer"] else 0)
    roles = {c: c for c in COMPONENTS}  # each component's identity carries the role of its name
    for d in _of(manifests, "Deployment"):
        zone, name = _component(d)
        pod = d["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        if not tls["enabled"]:
            assert "tls" not in vols and "KVMESH_TLS_CERT" not in env
            continue
        csi = vols["tls"]["csi"]
        attrs = csi["volumeAttributes"]
        assert csi["driver"] == "csi.cert-manager.io" and csi["readOnly"] is True
        assert attrs["csi.cert-manager.io/issuer-name"] == tls["issuer"]["name"]
        assert attrs["csi.cert-manager.io/issuer-kind"] == tls["issuer"]["kind"]
        uri = attrs["csi.cert-manager.io/uri-sans"]
        assert uri.endswith("/${POD_NAME}"), uri  # the CSI driver's per-pod variable: id = pod name
        ident = parse_spiffe_id(uri.replace("${POD_NAME}", f"{d['metadata']['name']}-7d9f-x2b4c"))
        assert (ident.role.value, ident.zone) == (roles[name], zone)
        # every name a peer dials is in the certificate: the Service's and the pod's own (its advertised address)
        pod_name, ns = f"{d['metadata']['name']}-7d9f-x2b4c", "prod"
        sans = attrs["csi.cert-manager.io/dns-names"].replace("${POD_NAME}", pod_name).replace("${POD_NAMESPACE}", ns)
        advertised = env["KVMESH_ADVERTISE_ADDRESS"].replace("$(KVMESH_SERVICE_ID)", pod_name)
        advertised = advertised.replace("$(POD_NAMESPACE)", ns).rsplit(":", 1)[0]
        assert {d["metadata"]["name"], f"{d['metadata']['name']}.{ns}.svc", advertised} <= set(sans.split(","))
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls")["mountPath"]
        for var in ("KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CLIENT_CA", "KVMESH_TLS_CA"):
            assert env[var].startswith(mount + "/")


_SETTINGS = {
    "router": "kvmesh.services.router.settings:RouterSettings",
    "cache-manager": "kvmesh.services.cache_manager.settings:CacheManagerSettings",
    "worker": "kvmesh.services.worker.settings:WorkerSettings",
    "failover": "kvmesh.services.failover.settings:FailoverSettings",
    "planner": "kvmesh.services.planner.settings:PlannerSettings",
}


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of variables defined earlier in the container's env."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def test_rendered_environment_is_accepted_by_the_services_settings(
    rendered: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    """Every KVMESH_* variable the chart sets names a field of the component's settings, and the services' own
    loader (`kvmesh.core.config.load_settings`) accepts the values (a typo or a bad value would be a crash loop)."""
    _, manifests = rendered
    for d in _of(manifests, "Deployment"):
        zone, name = _component(d)
        module, cls_name = _SETTINGS[name].split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        pod = f"{d['metadata']['name']}-7d9f-x2b4c"
        field_refs = {"metadata.name": pod, "metadata.namespace": "prod"}
        env: dict[str, str] = {}
        for e in d["spec"]["template"]["spec"]["containers"][0]["env"]:
            value = field_refs[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e else e["value"]
            env[e["name"]] = _expand(value, env)
        fields = {"KVMESH_" + f.name.upper() for f in dataclasses.fields(cls)}
        assert {k for k in env if k.startswith("KVMESH_")} - fields == set(), name
        settings = load_settings(cls, argv=[], env=env, service=name)
        assert (settings.zone, settings.service_id) == (zone, pod)
        pods = d["spec"]["template"]["spec"]["subdomain"]
        assert settings.advertise_address == f"{pod}.{pods}.prod.svc:{settings.port}"  # the pod's own DNS name
        headless = next(m for m in _of(manifests, "Service") if m["metadata"]["name"] == pods)
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["selector"] == d["spec"]["selector"]["matchLabels"]


def test_planner_scales_only_its_zones_workers(rendered: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    values, manifests = rendered
    deployments = {_component(d): d for d in _of(manifests, "Deployment")}
    for (zone, name), d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        mounts = pod["automountServiceAccountToken"]
        assert mounts is (name == "planner"), (zone, name)  # only the planner holds a Kubernetes token
        if name == "worker":
            assert ("replicas" in d["spec"]) is not values["planner"]["enabled"]  # else the planner owns it
    rbac = {(m["kind"], _component(m)) for m in manifests if m["kind"] in ("ServiceAccount", "Role", "RoleBinding")}
    if not values["planner"]["enabled"]:
        assert rbac == set()
        return
    for zone in (z["name"] for z in values["zones"]):
        d = deployments[(zone, "planner")]
        assert d["spec"]["strategy"] == {"type": "Recreate"} and d["spec"]["replicas"] == 1
        assert d["spec"]["template"]["spec"]["serviceAccountName"] == d["metadata"]["name"]
        env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        worker, router = deployments[(zone, "worker")], deployments[(zone, "router")]
        assert env["KVMESH_ACTUATOR"] == "kubernetes"
        assert env["KVMESH_KUBE_DEPLOYMENTS"] == f"{zone}={worker['metadata']['name']}"
        assert env["KVMESH_ROUTERS"] == f"{zone}={router['metadata']['name']}:{values['router']['grpcPort']}"
        assert "KVMESH_CONSUL_URL" not in env  # the planner is not registered (it refuses a Consul URL)
        (role,) = [m for m in _of(manifests, "Role") if _component(m) == (zone, "planner")]
        granted = {
            (r, v, tuple(rule.get("resourceNames", ())))
            for rule in role["rules"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }
        w = (worker["metadata"]["name"],)
        assert granted == {
            ("deployments", "get", w),
            ("deployments/scale", "get", w),
            ("deployments/scale", "patch", w),
            ("pods", "list", ()),
            ("pods", "patch", ()),
        }  # the calls of kvmesh.services.planner.kubernetes (tests/unit/services/planner/test_kubernetes.py)
        (binding,) = [m for m in _of(manifests, "RoleBinding") if _component(m) == (zone, "planner")]
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        (subject,) = binding["subjects"]
        assert (subject["kind"], subject["name"]) == ("ServiceAccount", d["metadata"]["name"]) and subject["namespace"]
