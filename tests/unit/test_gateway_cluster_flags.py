"""The gateway's discovery and planner flags, as the CLI translates them."""

from __future__ import annotations

import pytest

from services.cli import build_parser, main
from services.commands.gateway_cluster import (
    ClusterFlags,
    discovered_pools,
    parse_bounds,
    planner_config,
    pool_deployments,
)
from services.common.config_flags import from_args
from services.gateway.planner_rules import PlannerConfig, PoolBounds


def test_replica_bounds_are_min_colon_max():
    assert parse_bounds("2:10", "--decode-replicas") == PoolBounds(2, 10)
    for bad in ("3", "a:b", "5:2", ":4"):
        with pytest.raises(ValueError, match="--decode-replicas"):
            parse_bounds(bad, "--decode-replicas")


def test_planner_flags_become_its_config():
    args = build_parser().parse_args([
        "gateway", "--prefill", "h:1", "--decode", "h:2", "--planner-queue-drain-s", "90", "--planner-tpot-ms", "40",
        "--planner-prefill-headroom-beta", "1.5", "--prefill-replicas", "2:6", "--scale-down-window", "120",
        "--scale-cooldown", "30", "--colocated-replicas", "2:12", "--planner-slo-use-target", "0.7",
    ])
    config = planner_config(from_args(ClusterFlags, args))
    assert (config.queue_drain_s, config.tpot_s, config.prefill, config.decode) == (90, 0.04, PoolBounds(2, 6),
                                                                             PoolBounds(1, 8))
    assert (config.scale_down_window_s, config.cooldown_s, config.prefill_headroom_beta) == (120, 30, 1.5)
    assert (config.colocated, config.slo_use_target) == (PoolBounds(2, 12), 0.7)
    assert (args.discovery, args.planner) == ("static", "recommend")
    defaults = planner_config(from_args(ClusterFlags, build_parser().parse_args(["gateway", "--prefill", "h:1",
                                                                                 "--decode", "h:2"])))
    assert defaults.prefill_headroom_beta == PlannerConfig().prefill_headroom_beta == 0.6


def test_static_discovery_needs_both_lists_and_kubernetes_discovery_takes_none(capsys):
    assert main(["gateway", "--decode", "h:2"]) == 2
    assert "--prefill" in capsys.readouterr().err
    assert main(["gateway", "--discovery", "kubernetes", "--prefill", "h:1"]) == 2
    assert "--discovery kubernetes" in capsys.readouterr().err


def test_a_model_versions_pools_are_named_by_planner_deployment_flags():
    def args(*flags: str) -> ClusterFlags:
        return from_args(ClusterFlags, build_parser().parse_args(["gateway", "--prefill", "h:1", "--decode", "h:2",
                                                                  *flags]))

    # One model: its pools are the --k8s-prefill/--k8s-decode/--k8s-colocated Deployments, as before
    # versions; the flexible overlay names the colocated pool and empties the fixed ones.
    assert pool_deployments(args("--k8s-decode", "dec"), per_version=False) == {
        (None, "prefill"): "tandem-prefill", (None, "decode"): "dec"}
    flexible = args("--k8s-prefill=", "--k8s-decode=", "--k8s-colocated=tandem-worker")
    assert pool_deployments(flexible, per_version=False) == {(None, "colocated"): "tandem-worker"}
    canary = args("--planner-deployment", "smollm2@q4:prefill=tandem-prefill",
                  "--planner-deployment", "smollm2@fp32:decode=tandem-decode-fp32",
                  "--planner-deployment", "smollm2@bf16:colocated=tandem-worker-bf16")
    assert pool_deployments(canary, per_version=True) == {
        ("smollm2@q4", "prefill"): "tandem-prefill", ("smollm2@fp32", "decode"): "tandem-decode-fp32",
        ("smollm2@bf16", "colocated"): "tandem-worker-bf16"}
    with pytest.raises(ValueError, match="needs --model-repository"):
        pool_deployments(canary, per_version=False)
    for bad in ("smollm2:prefill=d", "smollm2@q4:router=d", "smollm2@q4:prefill=", "@q4:decode=d"):
        with pytest.raises(ValueError, match="--planner-deployment"):
            pool_deployments(args("--planner-deployment", bad), per_version=True)
    twice = args(*["--planner-deployment", "m@v:decode=a"] * 2)
    with pytest.raises(ValueError, match="named twice"):
        pool_deployments(twice, per_version=True)


def test_kubernetes_discovery_watches_the_pools_named_and_a_colocated_pool_when_asked():
    def pools(*flags: str) -> dict[str, str]:
        return discovered_pools(from_args(ClusterFlags, build_parser().parse_args(
            ["gateway", "--discovery", "kubernetes", *flags])))

    assert pools() == {"prefill": "tandem-prefill", "decode": "tandem-decode"}
    # The flexible shape: one pool of colocated workers, the fixed pools not watched.
    assert pools("--k8s-colocated", "tandem-worker", "--k8s-prefill", "", "--k8s-decode", "") == {
        "colocated": "tandem-worker"}
