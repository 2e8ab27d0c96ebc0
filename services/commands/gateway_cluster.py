"""The gateway's cluster flags (worker discovery and the planner) and what they translate into.

The Kubernetes client and the gateway's modules are imported only when the gateway runs, so that
building the `tandem` parser stays light.
"""

from __future__ import annotations

import argparse
import socket
from typing import TYPE_CHECKING

from services.gateway.planner_rules import PlannerConfig, PoolBounds

if TYPE_CHECKING:
    from services.gateway.discovery import KubernetesDiscovery
    from services.gateway.kube import Pool
    from services.gateway.planner import Planner
    from services.gateway.registry import WorkerRegistry

_LEASE_NAME = "tandem-planner"


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """Discovery (static lists or the Kubernetes API) and planner flags."""
    parser.add_argument("--discovery", default="static", choices=["static", "kubernetes"],
                        help="static: the --prefill/--decode lists; kubernetes: the ready endpoints of the "
                             "pools' Services (--k8s-prefill, --k8s-decode)")
    parser.add_argument("--k8s-namespace", default=None,
                        help="namespace of the pools (default: $POD_NAMESPACE, else this pod's namespace)")
    parser.add_argument("--k8s-prefill", default="tandem-prefill",
                        help="name of the prefill pool's Service and Deployment")
    parser.add_argument("--k8s-decode", default="tandem-decode",
                        help="name of the decode pool's Service and Deployment")
    parser.add_argument("--planner", default="recommend", choices=["off", "recommend", "apply"],
                        help="recommend: compute each pool's replicas; apply: also set them on the "
                             "Deployments (one gateway replica at a time, through a Lease)")
    parser.add_argument("--planner-deployment", action="append", default=[], metavar="NAME@VERSION:ROLE=DEPLOYMENT",
                        help="with --model-repository and --planner apply: the Deployment holding a version's "
                             "prefill or decode pool (repeat for each); a version's pool named by none is "
                             "only recommended. Without a repository the pools are --k8s-prefill/--k8s-decode")
    parser.add_argument("--planner-queue-drain-s", type=float, default=120.0,
                        help="seconds within which the planner sizes the prefill pool to drain its queue "
                             "(about how long a new replica takes to be ready)")
    parser.add_argument("--planner-prefill-headroom-beta", type=float, default=0.6,
                        help="square-root staffing headroom of the prefill pool: it runs load + BETA x "
                             "sqrt(load) replicas, load = prompt tokens/s over one replica's tokens/s")
    parser.add_argument("--planner-tpot-ms", type=float, default=100.0, help="TPOT target the planner sizes for")
    parser.add_argument("--planner-interval", type=float, default=15.0, help="seconds between plans")
    parser.add_argument("--prefill-replicas", default="1:8", help="MIN:MAX replicas of the prefill pool")
    parser.add_argument("--decode-replicas", default="1:8", help="MIN:MAX replicas of the decode pool")
    parser.add_argument("--scale-down-window", type=float, default=300.0,
                        help="seconds a lower replica count must stay recommended before a pool shrinks")
    parser.add_argument("--scale-cooldown", type=float, default=60.0,
                        help="seconds between two changes of a pool's replicas")


def parse_bounds(value: str, flag: str) -> PoolBounds:
    """`MIN:MAX` as PoolBounds; ValueError naming the flag."""
    low, sep, high = value.partition(":")
    if not sep or not low.isdigit() or not high.isdigit():
        raise ValueError(f"{flag}: {value!r} is not MIN:MAX")
    try:
        return PoolBounds(int(low), int(high))
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    """The PlannerConfig the flags describe."""
    return PlannerConfig(
        queue_drain_s=args.planner_queue_drain_s,
        prefill_headroom_beta=args.planner_prefill_headroom_beta,
        tpot_s=args.planner_tpot_ms / 1000,
        prefill=parse_bounds(args.prefill_replicas, "--prefill-replicas"),
        decode=parse_bounds(args.decode_replicas, "--decode-replicas"),
        scale_down_window_s=args.scale_down_window,
        cooldown_s=args.scale_cooldown,
        interval_s=args.planner_interval,
    )


def pool_deployments(args: argparse.Namespace, per_version: bool) -> dict[Pool, str]:
    """The Deployment of each pool the planner may scale: with a model repository (`per_version`),
    the versions' pools named by --planner-deployment; without one, the one model's pools
    (--k8s-prefill, --k8s-decode). ValueError naming the flag."""
    if not per_version:
        if args.planner_deployment:
            raise ValueError("--planner-deployment: names a model version's pools, which needs --model-repository")
        return {(None, "prefill"): args.k8s_prefill, (None, "decode"): args.k8s_decode}
    deployments: dict[Pool, str] = {}
    for value in args.planner_deployment:
        pool, _, deployment = value.partition("=")
        version, _, role = pool.rpartition(":")
        name, at, version_name = version.partition("@")
        if not (name and at and version_name and deployment) or role not in ("prefill", "decode"):
            raise ValueError(f"--planner-deployment: {value!r} is not NAME@VERSION:ROLE=DEPLOYMENT "
                             "(ROLE prefill or decode)")
        if (version, role) in deployments:
            raise ValueError(f"--planner-deployment: {version}'s {role} pool is named twice")
        deployments[version, role] = deployment
    return deployments


def cluster_services(args: argparse.Namespace, registry: WorkerRegistry,
                     per_version: bool) -> tuple[KubernetesDiscovery | None, Planner | None]:
    """Discovery (None for static lists) and the planner (None when off) for `registry`; with
    `per_version` (a model repository) the planner sizes each version's pools apart."""
    from kubernetes import client

    from services.gateway.discovery import KubernetesDiscovery
    from services.gateway.kube import DeploymentScale, LeaseElection, api_client, current_namespace
    from services.gateway.planner import Planner

    config = planner_config(args)
    deployments = pool_deployments(args, per_version)
    pools = {"prefill": args.k8s_prefill, "decode": args.k8s_decode}
    needs_api = args.discovery == "kubernetes" or args.planner == "apply"
    api = api_client() if needs_api else None
    namespace = args.k8s_namespace or current_namespace()
    discovery = None
    if args.discovery == "kubernetes":
        discovery = KubernetesDiscovery(registry, client.DiscoveryV1Api(api), namespace, pools)
    if args.planner == "off":
        return discovery, None
    if args.planner == "recommend":
        return discovery, Planner(registry, config, per_version=per_version)
    # The lease outlives a few plans, so that a busy leader keeps it and a dead one is soon replaced.
    election = LeaseElection(client.CoordinationV1Api(api), namespace, _LEASE_NAME, socket.gethostname(),
                             duration_s=max(15, round(3 * config.interval_s)))
    scale = DeploymentScale(client.AppsV1Api(api), namespace, deployments)
    return discovery, Planner(registry, config, scale, election, per_version=per_version)
