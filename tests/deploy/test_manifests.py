"""Every manifest under deploy/ against the Kubernetes schemas, and against each other.

Kubernetes' own kinds are validated strictly (unknown fields fail) by
``kubernetes-validate``, whose schemas ship in the package (no cluster, no network).
Custom resources (KServe's ClusterServingRuntime and InferenceService, the Prometheus
Operator's ServiceMonitor) are validated against ``support.k8s_schemas``: the fields of
their published CRDs that these manifests may use, strictly, with every embedded
Kubernetes type (Container, Volume, ResourceRequirements, ...) checked by Kubernetes'
own definition of it.

Then what only reading them together shows: the node file and the gateway file inside
the ConfigMaps load with rsrv's own loaders; the ports the node plans are the ports the
pods declare, the Services expose, the gateway resolves and Prometheus scrapes; probes
ask the health service for names it knows; selectors select the pods; the KServe
runtime serves the format, protocol and port the InferenceService asks for.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support import ROOT
from support.k8s_schemas import KUBERNETES_VERSION, crd_schemas

from rsrv.config import load_gateway, load_node, plan_node, split_address
from rsrv.protocol import HEALTH_SERVICES

DEPLOY = ROOT / "deploy"
MANIFESTS = sorted([*DEPLOY.glob("kubernetes/*.yaml"), *DEPLOY.glob("kserve/*.yaml")])
NODE_GPUS = 8  # the machines deploy/kubernetes/workers.yaml is written for


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


ALL = [(path, doc) for path in MANIFESTS for doc in documents(path)]


def named(kind: str, name: str) -> dict:
    [doc] = [d for _, d in ALL if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.fixture(scope="module")
def crds() -> dict:
    return crd_schemas()


def test_every_manifest_is_found():
    kinds = sorted({d["kind"] for _, d in ALL})
    assert kinds == [
        "ClusterServingRuntime",
        "ConfigMap",
        "DaemonSet",
        "Deployment",
        "InferenceService",
        "Namespace",
        "PodDisruptionBudget",
        "Service",
        "ServiceMonitor",
    ]


@pytest.mark.parametrize(
    "path, doc",
    ALL,
    ids=[f"{p.parent.name}/{p.name}:{d['kind']}/{d['metadata']['name']}" for p, d in ALL],
)
def test_manifest_is_valid(path, doc, crds):
    key = (doc["apiVersion"], doc["kind"])
    if key in crds:
        jsonschema.Draft202012Validator(crds[key]).validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_crd_schemas_catch_mistakes(crds):
    """The custom resource schemas are strict: a misspelt or misplaced field fails."""
    runtime = named("ClusterServingRuntime", "rsrv")
    for mutate in (
        lambda d: d["spec"].update(protocolVersion=["grpc-v2"]),  # singular: the ISVC's
        lambda d: d["spec"]["containers"][0].update(port=8001),
        lambda d: d["spec"]["supportedModelFormats"][0].update(autoselect=True),
        lambda d: d["spec"].update(protocolVersions=["grpc-v3"]),
    ):
        broken = copy.deepcopy(runtime)
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(
                crds[("serving.kserve.io/v1alpha1", "ClusterServingRuntime")]
            ).validate(broken)


# -- read together --------------------------------------------------------------------------


def config_text(config_map: dict, key: str, tmp_path: Path) -> Path:
    path = tmp_path / key
    path.write_text(config_map["data"][key])
    return path


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "ClusterServingRuntime":
        return spec["containers"]
    return spec["template"]["spec"]["containers"]


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_the_node_pods_ports_are_the_ports_the_node_plans(tmp_path):
    node_file = config_text(named("ConfigMap", "rsrv-node"), "node.toml", tmp_path)
    plan = plan_node(
        load_node(node_file), {"INFERENCE_SERVER_GPUS": str(NODE_GPUS)}, source=node_file
    )
    assert [w.endpoints.port for w in plan.workers] == [8101 + i for i in range(NODE_GPUS)]
    [container] = containers(named("DaemonSet", "rsrv-node"))
    ports = container_ports(container)
    for i, worker in enumerate(plan.workers):
        assert ports[f"w{i}-grpc"] == worker.endpoints.port
        assert ports[f"w{i}-metrics"] == worker.endpoints.metrics_port
    assert ports["node-metrics"] == plan.metrics_port
    # No gateway of the node's own: the cluster's fronts the workers (no port for it).
    assert not plan.gateway and not {"grpc", "gw-metrics"} & set(ports)
    assert plan.host == "0.0.0.0" and plan.workers[0].model_repo == "/mnt/models"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/mnt/models", plan.workers[0].cache_dir, "/etc/rsrv"} <= mounts


def test_the_gateway_resolves_every_worker_port_of_the_headless_service(tmp_path):
    gateway = load_gateway(
        config_text(named("ConfigMap", "rsrv-gateway"), "gateway.yaml", tmp_path), env={}
    )
    service = named("Service", "rsrv-workers")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    # (no cluster domain: the pod's DNS search list adds whichever the cluster has)
    name = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    grpc_ports = {p["port"] for p in service["spec"]["ports"] if p["name"].endswith("-grpc")}
    resolved = [split_address(a) for a in gateway.endpoints_dns]
    assert {host for host, _ in resolved} == {name}
    assert sorted(port for _, port in resolved) == sorted(grpc_ports)
    assert not gateway.endpoints
    [container] = containers(named("Deployment", "rsrv-gateway"))
    ports = container_ports(container)
    assert ports["grpc"] == split_address(gateway.listen.grpc)[1]
    assert ports["metrics"] == split_address(gateway.listen.metrics)[1]


def test_services_select_their_pods_and_target_declared_ports():
    for service in (d for _, d in ALL if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        [workload] = [
            d
            for _, d in ALL
            if d["kind"] in ("Deployment", "DaemonSet")
            and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert workload["spec"]["selector"]["matchLabels"] == selector
        declared = container_ports(containers(workload)[0])
        for port in service["spec"]["ports"]:
            assert declared[port["targetPort"]] == port["port"], port
            if port["name"].endswith("grpc"):
                assert port["appProtocol"] == "kubernetes.io/h2c"


def test_service_monitors_scrape_ports_of_the_services_they_select():
    services = [d for _, d in ALL if d["kind"] == "Service"]
    for monitor in (d for _, d in ALL if d["kind"] == "ServiceMonitor"):
        wanted = monitor["spec"]["selector"]["matchLabels"]
        [service] = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
        names = {p["name"] for p in service["spec"]["ports"]}
        scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
        assert scraped <= names
        assert scraped == {n for n in names if "metrics" in n}  # every metrics port


def test_probes_ask_names_the_health_service_knows():
    probes = 0
    for _, doc in ALL:
        if doc["kind"] not in ("Deployment", "DaemonSet", "ClusterServingRuntime"):
            continue
        for container in containers(doc):
            ports = set(container_ports(container).values())
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                grpc = container.get(kind, {}).get("grpc")
                if grpc is None:
                    continue
                probes += 1
                assert grpc["port"] in ports
                service = grpc.get("service", "")
                expected = "ready" if kind == "readinessProbe" else "live"
                assert HEALTH_SERVICES[service] == expected, (doc["metadata"]["name"], kind)
    assert probes == 4


def test_every_container_runs_as_the_image_user():
    for _, doc in ALL:
        if doc["kind"] not in ("Deployment", "DaemonSet", "ClusterServingRuntime"):
            continue
        pod = (
            doc["spec"]
            if doc["kind"] == "ClusterServingRuntime"
            else doc["spec"]["template"]["spec"]
        )
        for container in containers(doc):
            context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
            assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]


def test_the_kserve_runtime_serves_what_the_inference_service_asks(tmp_path):
    runtime = named("ClusterServingRuntime", "rsrv")
    isvc = named("InferenceService", "vision")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] == "stablehlo"
    assert {"name": "stablehlo", "version": "1", "autoSelect": True, "priority": 1} in runtime[
        "spec"
    ]["supportedModelFormats"]
    assert runtime["spec"]["protocolVersions"] == ["grpc-v2"] == [model["protocolVersion"]]
    [container] = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    assert container["args"] == ["/etc/rsrv/node.toml"]
    [port] = container["ports"]
    assert port["name"] == "h2c"  # what Knative requires of a gRPC port
    for resources in (container["resources"], model["resources"]):
        assert resources["limits"]["nvidia.com/gpu"] == "1"
        assert resources["requests"]["memory"] == resources["limits"]["memory"]
    # The image's node file, with the runtime's environment, on a one-GPU pod: one
    # worker on the h2c port, serving /mnt/models, its /metrics where KServe scrapes.
    env = {e["name"]: e["value"] for e in container["env"]}
    env["INFERENCE_SERVER_GPUS"] = "1"
    node_file = DEPLOY / "docker" / "node.toml"
    plan = plan_node(load_node(node_file), env, source=node_file)
    [worker] = plan.workers
    assert worker.endpoints.port == port["containerPort"] == plan.port
    assert worker.model_repo == "/mnt/models"
    annotations = runtime["spec"]["annotations"]
    assert int(annotations["prometheus.kserve.io/port"]) == worker.endpoints.metrics_port
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert worker.cache_dir in mounts
