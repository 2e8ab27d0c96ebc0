"""The flexible overlay: one pool of colocated workers in place of the fixed prefill and decode
pools, scaled by its own signal; it renders, validates and keeps what the gateway relies on."""

from __future__ import annotations

import kubernetes_validate
import pytest
from test_manifests import KUBERNETES_VERSION, _container, _find, _flag, _render


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return _render("flexible")


def test_every_object_validates_strictly_in_the_tandem_namespace(objects):
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "tandem", obj["metadata"]["name"]


def test_one_colocated_pool_replaces_the_fixed_ones(objects):
    for pool in ("prefill", "decode"):
        assert not [obj for obj in objects if obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")
                    == pool], pool
    (deployment,) = _find(objects, "Deployment", "worker")
    (service,) = _find(objects, "Service", "worker")
    (pdb,) = _find(objects, "PodDisruptionBudget", "worker")
    container = _container(deployment)
    assert container["args"][:2] == ["worker", "--role=colocated"]
    assert _flag(container, "host") == "0.0.0.0" and _flag(container, "advertise-host") == "$(POD_IP)"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port = int(_flag(container, "port"))
    assert {"name": "grpc", "containerPort": port} in container["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": port}, probe
    drain = float(_flag(container, "grace-period"))
    assert drain < deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] <= drain + 15
    assert {"name": "OTEL_SERVICE_NAME", "value": "tandem-worker"} in container["env"]


def test_the_gateway_discovers_the_colocated_pool_and_no_fixed_one(objects):
    (gateway,) = _find(objects, "Deployment", "gateway")
    container = _container(gateway)
    assert _flag(container, "discovery") == "kubernetes"
    assert (_flag(container, "k8s-colocated"), _flag(container, "k8s-prefill"), _flag(container, "k8s-decode")) == (
        "tandem-worker", "", "")


def test_the_pool_scales_on_the_gateways_predicted_use_of_the_objectives(objects):
    (deployment,) = _find(objects, "Deployment", "worker")
    assert "replicas" not in deployment["spec"], "the autoscaler, not the manifest, owns the replica count"
    (hpa,) = [obj for obj in objects if obj["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["external"]["metric"] == {"name": "tandem:pool_slo_use",
                                            "selector": {"matchLabels": {"role": "colocated"}}}
    assert metric["external"]["target"]["type"] == "AverageValue"
    (gateway,) = _find(objects, "Deployment", "gateway")
    assert _flag(_container(gateway), "planner") in ("off", "recommend")


def test_workers_reach_one_another_and_the_gateway_only_their_grpc_port(objects):
    (policy,) = _find(objects, "NetworkPolicy", "worker")
    sources = {rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: rule.get("ports")
               for rule in policy["spec"]["ingress"] if "from" in rule}
    assert sources == {"worker": None, "gateway": [{"port": 50081}]}


def test_the_gateway_may_scale_the_colocated_pool_and_no_other(objects):
    """For the planner in apply mode (components/planner-apply in place of hpa.yaml)."""
    (role,) = _find(objects, "Role", "gateway")
    scale = [rule for rule in role["rules"] if "deployments/scale" in rule["resources"]]
    assert [rule["resourceNames"] for rule in scale] == [["tandem-worker"]]
    (deployment,) = _find(objects, "Deployment", "worker")
    assert deployment["metadata"]["name"] == "tandem-worker"
