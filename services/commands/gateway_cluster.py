"""The gateway's cluster flags (worker discovery and the planner) and what they translate into.

The Kubernetes client and the gateway's modules are imported only when the gateway runs, so that
building the `tandem` parser stays light.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from services.common.config_flags import flag
from services.gateway.planner_rules import PlannerConfig, PoolBounds
from services.gateway.router import Role

if TYPE_CHECKING:
    from services.gateway.discovery import KubernetesDiscovery
    from services.gateway.kube import Pool
    from services.gateway.planner import Planner
    from services.gateway.registry import WorkerRegistry

_LEASE_NAME = "tandem-planner"


@dataclass(frozen=True)
class ClusterFlags:
    """Discovery (static lists or the Kubernetes API) and planner flags."""

    discovery: Literal["static", "kubernetes"] = flag(
        "static", "static: the --prefill/--decode/--colocated lists; kubernetes: the ready endpoints of the pools' "
        "Services (--k8s-prefill, --k8s-decode, --k8s-colocated)")
    k8s_namespace: str | None = flag(None, "namespace of the pools (default: $POD_NAMESPACE, else this pod's "
                                           "namespace)")
    k8s_prefill: str = flag("tandem-prefill", "name of the prefill pool's Service and Deployment")
    k8s_decode: str = flag("tandem-decode", "name of the decode pool's Service and Deployment")
    k8s_colocated: str = flag("", "name of the colocated pool's Service and Deployment (the flexible shape: one "
                                  "pool whose workers compute prompts and decode); \"\" for none. Each --k8s-* "
                                  "named \"\" is not watched")
    planner: Literal["off", "recommend", "apply"] = flag(
        "recommend", "recommend: compute each pool's replicas; apply: also set them on the Deployments (one "
        "gateway replica at a time, through a Lease)")
    planner_deployment: tuple[str, ...] = flag(
        (), "with --model-repository and --planner apply: the Deployment holding a version's prefill, decode or "
        "colocated pool (repeat for each); a version's pool named by none is only recommended. Without a "
        "repository the pools are --k8s-prefill/--k8s-decode/--k8s-colocated", metavar="NAME@VERSION:ROLE=DEPLOYMENT")
    planner_queue_drain_s: float = flag(120.0, "seconds within which the planner sizes the prefill pool to drain "
                                               "its queue (about how long a new replica takes to be ready)")
    planner_prefill_headroom_beta: float = flag(
        0.6, "square-root staffing headroom of the prefill pool: it runs load + BETA x sqrt(load) replicas, "
        "load = prompt tokens/s over one replica's tokens/s")
    planner_tpot_ms: float = flag(100.0, "TPOT target the planner sizes for")
    planner_interval: float = flag(15.0, "seconds between plans")
    prefill_replicas: str = flag("1:8", "MIN:MAX replicas of the prefill pool")
    decode_replicas: str = flag("1:8", "MIN:MAX replicas of the decode pool")
    colocated_replicas: str = flag("1:8", "MIN:MAX replicas of the colocated pool (the flexible shape)")
    planner_slo_use_target: float = flag(
        0.8, "the colocated pool's target per replica: the share of its TTFT or TPOT objective (the larger) the "
        "recent typical request would use on each worker, summed over the pool (tandem:pool_slo_use)")
    scale_down_window: float = flag(300.0, "seconds a lower replica count must stay recommended before a pool "
                                           "shrinks")
    scale_cooldown: float = flag(60.0, "seconds between two changes of a pool's replicas")


def parse_bounds(value: str, flag: str) -> PoolBounds:
    """`MIN:MAX` as PoolBounds; ValueError naming the flag."""
    low, sep, high = value.partition(":")
    if not sep or not low.isdigit() or not high.isdigit():
        raise ValueError(f"{flag}: {value!r} is not MIN:MAX")
    try:
        return PoolBounds(int(low), int(high))
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None


def planner_config(flags: ClusterFlags) -> PlannerConfig:
    """The PlannerConfig the flags describe."""
    return PlannerConfig(
        queue_drain_s=flags.planner_queue_drain_s,
        prefill_headroom_beta=flags.planner_prefill_headroom_beta,
        tpot_s=flags.planner_tpot_ms / 1000,
        prefill=parse_bounds(flags.prefill_replicas, "--prefill-replicas"),
        decode=parse_bounds(flags.decode_replicas, "--decode-replicas"),
        colocated=parse_bounds(flags.colocated_replicas, "--colocated-replicas"),
        slo_use_target=flags.planner_slo_use_target,
        scale_down_window_s=flags.scale_down_window,
        cooldown_s=flags.scale_cooldown,
        interval_s=flags.planner_interval,
    )


def pool_deployments(flags: ClusterFlags, per_version: bool) -> dict[Pool, str]:
    """The Deployment of each pool the planner may scale: with a model repository (`per_version`),
    the versions' pools named by --planner-deployment; without one, the one model's pools
    (--k8s-prefill, --k8s-decode). ValueError naming the flag."""
    if not per_version:
        if flags.planner_deployment:
            raise ValueError("--planner-deployment: names a model version's pools, which needs --model-repository")
        named = {(None, "prefill"): flags.k8s_prefill, (None, "decode"): flags.k8s_decode,
                 (None, "colocated"): flags.k8s_colocated}
        return {pool: deployment for pool, deployment in named.items() if deployment}
    deployments: dict[Pool, str] = {}
    for value in flags.planner_deployment:
        pool, _, deployment = value.partition("=")
        version, _, role = pool.rpartition(":")
        name, at, version_name = version.partition("@")
        if not (name and at and version_name and deployment) or role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"--planner-deployment: {value!r} is not NAME@VERSION:ROLE=DEPLOYMENT "
                             "(ROLE prefill, decode or colocated)")
        if (version, role) in deployments:
            raise ValueError(f"--planner-deployment: {version}'s {role} pool is named twice")
        deployments[version, role] = deployment
    return deployments


def discovered_pools(flags: ClusterFlags) -> dict[Role, str]:
    """The Service of each pool the gateway discovers (--k8s-prefill, --k8s-decode, --k8s-colocated;
    one named "" is not watched)."""
    named: dict[Role, str] = {"prefill": flags.k8s_prefill, "decode": flags.k8s_decode,
                              "colocated": flags.k8s_colocated}
    return {role: service for role, service in named.items() if service}


def cluster_services(flags: ClusterFlags, registry: WorkerRegistry,
                     per_version: bool) -> tuple[KubernetesDiscovery | None, Planner | None]:
    """Discovery (None for static lists) and the planner (None when off) for `registry`; with
    `per_version` (a model repository) the planner sizes each version's pools apart."""
    from kubernetes import client

    from services.gateway.discovery import KubernetesDiscovery
    from services.gateway.kube import DeploymentScale, LeaseElection, api_client, current_namespace
    from services.gateway.planner import Planner

    config = planner_config(flags)
    deployments = pool_deployments(flags, per_version)
    pools = discovered_pools(flags)
    needs_api = flags.discovery == "kubernetes" or flags.planner == "apply"
    api = api_client() if needs_api else None
    namespace = flags.k8s_namespace or current_namespace()
    discovery = None
    if flags.discovery == "kubernetes":
        discovery = KubernetesDiscovery(registry, client.DiscoveryV1Api(api), namespace, pools)
    if flags.planner == "off":
        return discovery, None
    if flags.planner == "recommend":
        return discovery, Planner(registry, config, per_version=per_version)
    # The lease outlives a few plans, so that a busy leader keeps it and a dead one is soon replaced.
    election = LeaseElection(client.CoordinationV1Api(api), namespace, _LEASE_NAME, socket.gethostname(),
                             duration_s=max(15, round(3 * config.interval_s)))
    scale = DeploymentScale(client.AppsV1Api(api), namespace, deployments)
    return discovery, Planner(registry, config, scale, election, per_version=per_version)
