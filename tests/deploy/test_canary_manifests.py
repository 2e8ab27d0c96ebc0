"""The canary overlay (two model versions from one repository, each on its own Deployments) and the
Gateway API Inference Extension component: they render, validate, and wire the repository through."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
from test_manifests import KUBERNETES_VERSION, ROOT, _container, _flag, _render

from services.repository.config import parse_repository

REPOSITORY_FLAG = "--model-repository=/etc/tandem/models/models.toml"
INFERENCE_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"),
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceModelRewrite"),
}


@pytest.fixture(scope="module")
def canary() -> list[dict]:
    objects = _render("canary")
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    return objects


def _deployments(objects: list[dict]) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Deployment"}


def _repository(objects: list[dict]):
    [config_map] = [obj for obj in objects if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "tandem-models"]
    return parse_repository(tomllib.loads(config_map["data"]["models.toml"]), "models.toml")


def test_every_worker_serves_the_version_its_pool_is_assigned(canary):
    repository = _repository(canary)
    pools = {version.pool: version.name for version in repository.versions}
    served = {}
    for name, deployment in _deployments(canary).items():
        container = _container(deployment)
        role = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        if role not in ("prefill", "decode"):
            continue
        assert REPOSITORY_FLAG in container["args"], name
        assert container["volumeMounts"] == [{"name": "models", "mountPath": "/etc/tandem/models", "readOnly": True}]
        version = pools[_flag(container, "pool")]
        assert deployment["spec"]["template"]["metadata"]["labels"]["tandem.dev/model-version"] == version
        served.setdefault(version, set()).add(role)
    # Each version has a whole disaggregated pool: its own prefill and decode workers.
    assert served == {"q4": {"prefill", "decode"}, "fp32": {"prefill", "decode"}}
    assert REPOSITORY_FLAG in _container(_deployments(canary)["tandem-gateway"])["args"]


def test_the_versions_deployments_select_only_their_own_pods_and_the_pool_services_reach_all(canary):
    deployments = [d for d in _deployments(canary).values()
                   if d["metadata"]["labels"]["app.kubernetes.io/component"] in ("prefill", "decode")]
    services = {obj["metadata"]["name"]: obj["spec"]["selector"] for obj in canary if obj["kind"] == "Service"}
    for deployment in deployments:
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        owners = [other["metadata"]["name"] for other in deployments
                  if other["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()]
        assert owners == [deployment["metadata"]["name"]]
        role = pod_labels["app.kubernetes.io/component"]
        assert services[f"tandem-{role}"].items() <= pod_labels.items()  # discovery finds it


def test_the_inference_extension_component_splits_the_name_between_the_served_versions(tmp_path: Path):
    overlay = os.path.relpath(ROOT / "deploy/k8s/overlays/canary", tmp_path)
    component = os.path.relpath(ROOT / "deploy/k8s/components/inference-extension", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{overlay}]\ncomponents: [{component}]\n")
    objects = _render(tmp_path)
    custom = {kind: obj for obj in objects if (kind := (obj["apiVersion"], obj["kind"])) in INFERENCE_KINDS}
    assert set(custom) == INFERENCE_KINDS
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) not in INFERENCE_KINDS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    pool = custom[("inference.networking.k8s.io/v1", "InferencePool")]
    gateway = _deployments(objects)["tandem-gateway"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": int(_flag(_container(gateway), "http-port"))}]
    [rule] = custom[("inference.networking.x-k8s.io/v1alpha2", "InferenceModelRewrite")]["spec"]["rules"]
    repository = _repository(objects)
    model = repository.model(rule["matches"][0]["model"]["value"])
    assert {target["modelRewrite"]: target["weight"] for target in rule["targets"]} == {
        version.version_key: weight for version, weight in model.weights}
    for kind in ("InferenceObjective", "InferenceModelRewrite"):
        [obj] = [o for o in objects if o["kind"] == kind]
        assert obj["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
