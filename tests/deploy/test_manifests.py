"""The Kubernetes manifests: each overlay renders, validates against the Kubernetes 1.33 schemas,
and keeps the structure the gateway and the operators rely on."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["cpu", "gpu", "gpu-moe"]
POOLS = ["prefill", "decode"]
KUBERNETES_VERSION = "1.33.0"
# Custom resources whose schemas kubernetes-validate does not ship; their structure is checked below.
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject")}
AUTOSCALER_KINDS = {"HorizontalPodAutoscaler", "ScaledObject"}


def _render(name: str | Path) -> list[dict]:
    """The objects of an overlay (a name under deploy/k8s/overlays, or a folder) as `kubectl
    kustomize` renders them."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the overlays"
    folder = name if isinstance(name, Path) else ROOT / "deploy/k8s/overlays" / name
    rendered = subprocess.run([kubectl, "kustomize", str(folder)], check=True, capture_output=True, text=True).stdout
    return [obj for obj in yaml.safe_load_all(rendered) if obj]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    """An overlay's name and its rendered objects."""
    return request.param, _render(request.param)


def _find(objects: list[dict], kind: str, component: str) -> list[dict]:
    return [obj for obj in objects
            if obj["kind"] == kind and obj["metadata"]["labels"].get("app.kubernetes.io/component") == component]


def _container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _flag(container: dict, name: str) -> str | None:
    values = [arg.split("=", 1)[1] for arg in container["args"] if arg.startswith(f"--{name}=")]
    return values[-1] if values else None


def test_every_object_validates_strictly(overlay):
    _, objects = overlay
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_every_object_is_namespaced_in_tandem(overlay):
    _, objects = overlay
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "tandem", obj["metadata"]["name"]


@pytest.mark.parametrize("pool", POOLS)
def test_each_pool_has_its_own_deployment_service_autoscaler_and_pdb(overlay, pool):
    _, objects = overlay
    (deployment,) = _find(objects, "Deployment", pool)
    (service,) = _find(objects, "Service", pool)
    (pdb,) = _find(objects, "PodDisruptionBudget", pool)
    autoscalers = [obj for kind in AUTOSCALER_KINDS for obj in _find(objects, kind, pool)]
    assert len(autoscalers) == 1, "exactly one thing sets a pool's replicas"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["app.kubernetes.io/component"] == pool
    assert service["spec"]["clusterIP"] == "None", "the gateway discovers pool pods, so the Service is headless"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (autoscaler,) = autoscalers
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"], "the autoscaler, not the manifest, owns the replica count"


def test_the_planner_only_recommends_where_an_autoscaler_sets_replicas(overlay):
    _, objects = overlay
    (gateway,) = _find(objects, "Deployment", "gateway")
    planner = _flag(_container(gateway), "planner")
    has_autoscalers = any(obj["kind"] in AUTOSCALER_KINDS for obj in objects)
    assert planner in ("off", "recommend") if has_autoscalers else planner == "apply"


@pytest.mark.parametrize("component", ["gateway", *POOLS])
def test_probes_use_grpc_health_on_the_serving_port(overlay, component):
    _, objects = overlay
    (deployment,) = _find(objects, "Deployment", component)
    container = _container(deployment)
    port = int(_flag(container, "port"))
    assert {"name": "grpc", "containerPort": port} in container["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": port}, probe


@pytest.mark.parametrize("component", ["gateway", *POOLS])
def test_termination_grace_covers_the_drain(overlay, component):
    _, objects = overlay
    (deployment,) = _find(objects, "Deployment", component)
    drain = float(_flag(_container(deployment), "grace-period"))
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert drain < grace <= drain + 15


@pytest.mark.parametrize("component", ["gateway", *POOLS])
def test_services_send_traces_to_jaeger(overlay, component):
    _, objects = overlay
    (config,) = [obj for obj in objects if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "tandem-config"]
    (jaeger,) = [obj for obj in objects if obj["kind"] == "Service" and obj["metadata"]["name"] == "jaeger"]
    assert {port["port"] for port in jaeger["spec"]["ports"]} == {4317, 4318, 16686}
    assert config["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    (deployment,) = _find(objects, "Deployment", component)
    container = _container(deployment)
    assert {"configMapRef": {"name": "tandem-config"}} in container["envFrom"]
    assert {"name": "OTEL_SERVICE_NAME", "value": f"tandem-{component}"} in container["env"]


def test_workers_listen_everywhere_and_decode_advertises_its_pod_ip(overlay):
    _, objects = overlay
    for pool in POOLS:
        (deployment,) = _find(objects, "Deployment", pool)
        assert _flag(_container(deployment), "host") == "0.0.0.0"
    (decode,) = _find(objects, "Deployment", "decode")
    container = _container(decode)
    assert _flag(container, "advertise-host") == "$(POD_IP)"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]


def test_gateway_has_grpc_and_http_ports_and_discovers_through_the_api(overlay):
    _, objects = overlay
    (gateway,) = _find(objects, "Deployment", "gateway")
    (service,) = _find(objects, "Service", "gateway")
    (pdb,) = _find(objects, "PodDisruptionBudget", "gateway")
    container = _container(gateway)
    assert _flag(container, "discovery") == "kubernetes"
    assert {port["name"]: port["port"] for port in service["spec"]["ports"]} == {"grpc": 50051, "http": 8000}
    assert gateway["spec"]["replicas"] >= 2 and pdb["spec"]["minAvailable"] == 1
    assert gateway["spec"]["template"]["spec"]["serviceAccountName"] == "tandem-gateway"


def test_gateway_rbac_grants_exactly_discovery_scaling_and_its_lease(overlay):
    _, objects = overlay
    (role,) = [obj for obj in objects if obj["kind"] == "Role"]
    granted = {
        (group, resource, verb, name)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        for name in rule.get("resourceNames", ["*"])
    }
    assert granted == {
        *{("discovery.k8s.io", "endpointslices", verb, "*") for verb in ("get", "list", "watch")},
        *{("apps", "deployments/scale", verb, name)
          for verb in ("get", "patch") for name in ("tandem-prefill", "tandem-decode")},
        ("coordination.k8s.io", "leases", "create", "*"),
        *{("coordination.k8s.io", "leases", verb, "tandem-planner") for verb in ("get", "update")},
    }
    (binding,) = [obj for obj in objects if obj["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tandem-gateway", "namespace": "tandem"}]
    assert not [obj for obj in objects if obj["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_scaled_objects_target_their_pool(overlay):
    _, objects = overlay
    for obj in objects:
        if obj["kind"] == "ScaledObject":
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            assert obj["spec"]["scaleTargetRef"] == {"name": f"tandem-{component}"}
            assert obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]
            assert all(trigger["type"] == "prometheus" for trigger in obj["spec"]["triggers"])


def test_gpu_overlay_puts_workers_on_gpus_in_bf16_the_decode_pool_at_tensor_parallel_size_3():
    objects = _render("gpu")
    for pool, size in (("prefill", 1), ("decode", 3)):
        (deployment,) = _find(objects, "Deployment", pool)
        container = _container(deployment)
        # One pod is one worker: a GPU for each of its ranks.
        assert container["resources"]["limits"]["nvidia.com/gpu"] == size
        assert container["resources"]["requests"]["nvidia.com/gpu"] == size
        assert int(_flag(container, "tensor-parallel-size") or 1) == size
        assert _flag(container, "device") == "cuda" and _flag(container, "dtype") == "bfloat16"
        assert any(env["name"].startswith("NCCL_") for env in container["env"])
        assert deployment["spec"]["template"]["spec"]["tolerations"]
        assert container["image"].endswith("-cuda")


def test_the_moe_overlay_runs_decode_with_experts_split_whole_beside_prefill_of_another_layout():
    objects = _render("gpu-moe")
    layouts = {}
    for pool in POOLS:
        (deployment,) = _find(objects, "Deployment", pool)
        container = _container(deployment)
        size = int(_flag(container, "tensor-parallel-size") or 1)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == size
        layouts[pool] = (size, "--enable-expert-parallel" in container["args"])
        # Both pools serve the same checkpoint from the read-only models volume.
        assert _flag(container, "model") == "/models/Qwen3-30B-A3B"
        assert container["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True}]
        (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
        assert volume["persistentVolumeClaim"] == {"claimName": "tandem-models", "readOnly": True}
    assert layouts == {"prefill": (2, False), "decode": (4, True)}


def render_with_components(tmp_path: Path, *components: str) -> list[dict]:
    """base with the named components (under deploy/k8s/components), rendered in `tmp_path` and
    validated strictly."""
    # kustomize takes only relative paths to other kustomizations.
    base = os.path.relpath(ROOT / "deploy/k8s/base", tmp_path)
    paths = ", ".join(os.path.relpath(ROOT / "deploy/k8s/components" / name, tmp_path) for name in components)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{base}]\ncomponents: [{paths}]\n"
    )
    objects = _render(tmp_path)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    return objects


def test_the_planner_apply_component_leaves_the_replicas_to_the_planner(tmp_path):
    objects = render_with_components(tmp_path, "planner-apply")
    assert not [obj for obj in objects if obj["kind"] in AUTOSCALER_KINDS]
    (gateway,) = _find(objects, "Deployment", "gateway")
    assert [arg for arg in _container(gateway)["args"] if arg.startswith("--planner")] == ["--planner=apply"]


def test_the_cpu_overlay_runs_a_host_tier_per_node_and_gives_each_worker_it_and_a_disk_tier():
    objects = _render("cpu")
    (daemon,) = [obj for obj in objects if obj["kind"] == "DaemonSet"]
    owner = _container(daemon)
    socket_path = _flag(owner, "socket")
    host_volume = daemon["spec"]["template"]["spec"]["volumes"][0]
    assert owner["args"][0] == "kv-host-tier" and host_volume["hostPath"]["path"] == os.path.dirname(socket_path)
    for pool in POOLS:
        (deployment,) = _find(objects, "Deployment", pool)
        container = _container(deployment)
        assert _flag(container, "kv-host-tier") == socket_path
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mounts[os.path.dirname(socket_path)]]["hostPath"] == host_volume["hostPath"]
        assert "emptyDir" in volumes[mounts[_flag(container, "kv-disk-tier")]]


def test_the_kv_tiers_component_keeps_the_tls_volumes(tmp_path):
    objects = render_with_components(tmp_path, "tls", "kv-tiers")
    for pool in POOLS:
        (deployment,) = _find(objects, "Deployment", pool)
        names = {volume["name"] for volume in deployment["spec"]["template"]["spec"]["volumes"]}
        assert {"tls", "kv-host-tier", "kv-disk-tier"} <= names
