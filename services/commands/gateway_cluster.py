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


def cluster_services(args: argparse.Namespace,
                     registry: WorkerRegistry) -> tuple[KubernetesDiscovery | None, Planner | None]:
    """Discovery (None for static lists) and the planner (None when off) for `registry`."""
    from kubernetes import client

    from services.gateway.discovery import KubernetesDiscovery
    from services.gateway.kube import DeploymentScale, LeaseElection, api_client, current_namespace
    from services.gateway.planner import Planner

    config = planner_config(args)
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
        return discovery, Planner(registry, config)
    # The lease outlives a few plans, so that a busy leader keeps it and a dead one is soon replaced.
    election = LeaseElection(client.CoordinationV1Api(api), namespace, _LEASE_NAME, socket.gethostname(),
                             duration_s=max(15, round(3 * config.interval_s)))
    return discovery, Planner(registry, config, DeploymentScale(client.AppsV1Api(api), namespace, pools), election)
