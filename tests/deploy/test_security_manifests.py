"""The security parts of the Kubernetes manifests: the NetworkPolicies in base, and the tls and
api-keys components (rendered over base, validated against the Kubernetes schemas)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_manifests import OVERLAYS, _container, _find, _flag, _render, render_with_components

PORTS = {"prefill": 50061, "decode": 50071}
TLS_FLAGS = {"tls-cert": "/etc/tandem/tls/tls.crt", "tls-key": "/etc/tandem/tls/tls.key",
             "tls-ca": "/etc/tandem/tls/ca.crt", "tls-server-name": "tandem-worker"}


def _selects(peer: dict, component: str) -> bool:
    return peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == component


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_prefill_reaches_every_decode_port_and_the_gateway_only_grpc(overlay: str) -> None:
    objects = _render(overlay)
    (policy,) = _find(objects, "NetworkPolicy", "decode")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from", [])
        if not peers:  # from anywhere: only the metrics port
            assert [port["port"] for port in rule["ports"]] == [9090]
        elif any(_selects(peer, "prefill") for peer in peers):
            assert "ports" not in rule  # the rendezvous and gloo use ephemeral ports
        else:
            assert all(_selects(peer, "gateway") for peer in peers)
            assert [port["port"] for port in rule["ports"]] == [PORTS["decode"]]
    (prefill_policy,) = _find(objects, "NetworkPolicy", "prefill")
    open_ports = [rule["ports"] for rule in prefill_policy["spec"]["ingress"] if not rule.get("from")]
    assert open_ports == [[{"port": 9090}]]


@pytest.mark.parametrize("component", ["gateway", "prefill", "decode"])
def test_the_tls_component_mounts_the_secret_and_passes_the_files(tmp_path: Path, component: str) -> None:
    (deployment,) = _find(render_with_components(tmp_path, "tls"), "Deployment", component)
    pod = deployment["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["secret"]["secretName"] == f"tandem-{component}-tls"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    container = _container(deployment)
    assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": "/etc/tandem/tls", "readOnly": True}]
    assert {name: _flag(container, name) for name in TLS_FLAGS} == TLS_FLAGS


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_tls_workers_are_probed_with_their_own_certificate(tmp_path: Path, component: str) -> None:
    (deployment,) = _find(render_with_components(tmp_path, "tls"), "Deployment", component)
    container = _container(deployment)
    expected = ["tandem", "probe", f"127.0.0.1:{PORTS[component]}", *(f"--{k}={v}" for k, v in TLS_FLAGS.items())]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in container[probe]
        assert container[probe]["exec"]["command"] == expected


def test_the_tls_gateway_is_probed_over_https(tmp_path: Path) -> None:
    (deployment,) = _find(render_with_components(tmp_path, "tls"), "Deployment", "gateway")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _container(deployment)[probe]["httpGet"] == {"scheme": "HTTPS", "path": "/health", "port": 8000}


def test_the_api_keys_component_reads_the_key_file_from_a_secret(tmp_path: Path) -> None:
    for components in (("api-keys",), ("tls", "api-keys")):
        (deployment,) = _find(render_with_components(tmp_path, *components), "Deployment", "gateway")
        container = _container(deployment)
        assert "--api-key-file=/etc/tandem/api-keys/keys.toml" in container["args"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
        assert (mount["mountPath"], mount["readOnly"]) == ("/etc/tandem/api-keys", True)
        volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["api-keys"]["secret"]["secretName"] == "tandem-api-keys"
        # Beside the TLS volume, not instead of it.
        assert ("tls" in components) == any(name != "api-keys" for name in volumes)
