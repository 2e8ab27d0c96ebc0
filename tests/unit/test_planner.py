"""The planner over a registry's load reports, one model's pools or each model version's, and apply
mode's Kubernetes calls: the Deployments' scale subresource and leader election through a Lease.

No Kubernetes API server can run here: apply mode drives the real `kubernetes` client against
`fake_kube_api.FakeKubeApi`, a local HTTP server implementing those endpoints. The workers are
registry entries whose load reports the test sets (what their WatchLoad streams would deliver).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math

import pytest
from fake_kube_api import FakeKubeApi
from kubernetes import client
from tandem.v1 import common_pb2

from services.common.convert import step_model_to_proto
from services.common.step_model import StepModel
from services.gateway.kube import DeploymentScale, LeaseElection, Pool
from services.gateway.planner import Planner, decode_demand, prefill_demand
from services.gateway.planner_rules import PlannerConfig, PoolBounds
from services.gateway.registry import WorkerRegistry
from services.gateway.router import SloTargets

CONFIG = PlannerConfig(queue_drain_s=1.0, tpot_s=0.1, target_utilisation=0.8, kv_target_utilisation=0.8,
                       prefill=PoolBounds(1, 6), decode=PoolBounds(1, 6), scale_down_window_s=0, cooldown_s=0)
DEPLOYMENTS = {(None, "prefill"): "tandem-prefill", (None, "decode"): "tandem-decode"}
Q4, FP32 = "smollm2@q4", "smollm2@fp32"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class WallClock:
    """The time the replicas write into the Lease; it moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)

    def __call__(self) -> datetime.datetime:
        return self.now


def loaded_registry() -> WorkerRegistry:
    """One prefill worker measured at 500 tokens/s with 400 queued, one decode worker holding 900 of
    its 1000 KV blocks."""
    registry = WorkerRegistry(prefill=["10.0.0.1:50061"], decode=["10.0.1.1:50071"])
    prefill, decode = registry.workers
    prefill.serving = decode.serving = True
    prefill.report = common_pb2.LoadReport(role="prefill", queued_prompt_tokens=400, prefill_tokens_per_s=500.0,
                                           total_kv_blocks=1000, free_kv_blocks=1000, block_size=16)
    decode.report = common_pb2.LoadReport(role="decode", running_requests=8, total_kv_blocks=1000,
                                          used_kv_blocks=900, free_kv_blocks=100, tpot_s=0.02, block_size=16)
    return registry


def test_recommendations_follow_the_routed_prompt_tokens_and_the_reports():
    async def scenario() -> None:
        clock = Clock()
        registry = loaded_registry()
        planner = Planner(registry, CONFIG, clock=clock)
        _, decode = registry.workers
        # First sample: no rate yet; the queue alone needs 400 / 500 -> 1 replica.
        # Decode: 900 blocks / (1000 x 0.8) -> 2.
        assert planner.recommend() == {(None, "prefill"): 1, (None, "decode"): 2}
        # 10 s during which the gateway routes 20,000 prompt tokens: 2000 tokens/s + the queue's 400.
        for i in range(20):
            request = registry.route_request(list(range(1000 * i, 1000 * (i + 1))), max_tokens=16)
            registry.claim(request, registry.decide(request)).release()
        clock.now += 10
        assert planner.recommend() == {(None, "prefill"): 6, (None, "decode"): 2}  # 4 + 0.6 x sqrt(4) + 400 / 500
        clock.now += 10
        assert planner.recommend()[None, "prefill"] == 1, "nothing routed since"
        # A worker that stops serving is not counted; a pool without any has no recommendation.
        decode.serving = False
        assert planner.recommend()[None, "decode"] is None
        await registry.close()

    asyncio.run(scenario())


def versioned_registry() -> WorkerRegistry:
    """A repository's two versions on their own workers: q4 with an idle prefill worker (500 tokens/s)
    and a decode worker holding 900 of its 1000 KV blocks; the fp32 canary with 1000 prompt tokens
    queued on its slower prefill worker (250 tokens/s) and 100 KV blocks used."""
    registry = WorkerRegistry(prefill=["10.0.0.1:50061", "10.0.0.2:50061"],
                              decode=["10.0.1.1:50071", "10.0.1.2:50071"])
    q4_prefill, fp32_prefill, q4_decode, fp32_decode = registry.workers
    for worker, (name, version) in zip(registry.workers, [Q4.split("@"), FP32.split("@")] * 2, strict=True):
        worker.serving = True
        worker.report = common_pb2.LoadReport(role=worker.role, model_name=name, model_version=version,
                                               total_kv_blocks=1000, free_kv_blocks=1000, block_size=16)
    q4_prefill.report.prefill_tokens_per_s = 500.0
    fp32_prefill.report.MergeFrom(common_pb2.LoadReport(prefill_tokens_per_s=250.0, queued_prompt_tokens=1000))
    q4_decode.report.MergeFrom(common_pb2.LoadReport(running_requests=8, used_kv_blocks=900, tpot_s=0.02))
    fp32_decode.report.MergeFrom(common_pb2.LoadReport(running_requests=1, used_kv_blocks=100, tpot_s=0.02))
    for decode in (q4_decode, fp32_decode):
        decode.report.free_kv_blocks = 1000 - decode.report.used_kv_blocks
    return registry


def test_each_model_versions_pools_are_sized_from_its_own_workers_and_routed_tokens():
    async def scenario() -> None:
        clock = Clock()
        registry = versioned_registry()
        planner = Planner(registry, CONFIG, clock=clock, per_version=True)
        # q4: nothing queued -> 1 prefill replica; 900 / (1000 x 0.8) -> 2 decode. fp32: its queue
        # needs 1000 / 1 s / 250 -> 4 prefill replicas; 100 blocks -> 1 decode.
        assert planner.recommend() == {(Q4, "prefill"): 1, (Q4, "decode"): 2,
                                       (FP32, "prefill"): 4, (FP32, "decode"): 1}
        # 10,000 prompt tokens routed to q4 over 10 s: 1000 tokens/s, a load of 2 q4 replicas; fp32
        # got none, so its count is its queue's alone.
        for i in range(10):
            request = registry.route_request(list(range(1000 * i, 1000 * (i + 1))), max_tokens=16, version_key=Q4)
            registry.claim(request, registry.decide(request)).release()
        clock.now += 10
        recommended = planner.recommend()
        assert (recommended[Q4, "prefill"], recommended[FP32, "prefill"]) == (3, 4)  # 2 + 0.6 x sqrt(2) -> 3
        # Without a repository the same workers are one model's pools: both versions' loads add up.
        # (Prefill: 1000 queued tokens at the mean 375 tokens/s -> 3; decode: 1000 blocks used / 800 -> 2.)
        assert Planner(registry, CONFIG, clock=clock).recommend() == {(None, "prefill"): 3, (None, "decode"): 2}
        await registry.close()

    asyncio.run(scenario())


def flexible_registry() -> WorkerRegistry:
    """The flexible shape's pool: two colocated workers, 1 ms a prompt token, 20 ms a decode step plus
    2 ms a sequence, one idle and one running 6 sequences, with a 50 ms TPOT objective."""
    model = StepModel(base_s=0.020, per_prompt_token_s=0.001, per_sequence_s=0.002)
    registry = WorkerRegistry(colocated=["10.0.3.1:50081", "10.0.3.2:50081"],
                              default_slo=SloTargets(ttft_s=1.0, tpot_s=0.050))
    for worker, running in zip(registry.workers, (0, 6), strict=True):
        worker.serving = True
        worker.report = common_pb2.LoadReport(
            role="colocated", block_size=16, total_kv_blocks=100, free_kv_blocks=100, model_name="m",
            running_requests=running, step_model=step_model_to_proto(model), max_num_batched_tokens=512)
    return registry


def colocated_use(registry: WorkerRegistry) -> float:
    """tandem:pool_slo_use of the colocated pool, over the versions its workers report."""
    return sum(use for (_, role), use in registry.pool_slo_use().items() if role == "colocated")


def test_a_colocated_pool_is_sized_on_what_the_typical_request_would_use_of_its_objectives():
    """The flexible shape's planner signal is its HPA's (tandem:pool_slo_use): summed over the pool,
    kept at 0.8 a replica; nothing before a request was placed, and no fixed pool is invented."""
    async def scenario() -> None:
        registry = flexible_registry()
        planner = Planner(registry, CONFIG, clock=Clock())
        assert planner.recommend() == {(None, "prefill"): None, (None, "decode"): None, (None, "colocated"): None}
        request = registry.route_request(list(range(300)), max_tokens=100)
        registry.claim(request, registry.decide(request)).release()
        use = colocated_use(registry)
        assert planner.recommend()[None, "colocated"] == math.ceil(use / 0.8) == 2
        busy = registry.workers[1].report
        busy.running_requests, busy.queued_prompt_tokens = 30, 3000
        assert colocated_use(registry) > 2 * use
        assert planner.recommend()[None, "colocated"] == min(6, math.ceil(colocated_use(registry) / 0.8)) > 2
        await registry.close()

    asyncio.run(scenario())


def test_prefill_demand_counts_the_pools_queued_prompts():
    reports = [common_pb2.LoadReport(role="prefill", queued_prompt_tokens=300, waiting_requests=2,
                                     prefill_tokens_per_s=400.0),
               common_pb2.LoadReport(role="prefill", queued_prompt_tokens=100, waiting_requests=1,
                                     prefill_tokens_per_s=600.0)]
    demand = prefill_demand(250.0, reports)
    assert (demand.queued_prompt_tokens, demand.queued_requests, demand.tokens_per_s_per_replica) == (400, 3, 500.0)


def test_decode_demand_takes_the_fitted_step_models_with_the_pools_context_per_sequence():
    def report(running: int, context: int, base: float, per_sequence: float) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(role="decode", running_requests=running, context_tokens=context,
                                     total_kv_blocks=1000, tpot_s=0.08, step_model=common_pb2.StepModel(
                                         base_s=base, per_sequence_s=per_sequence, per_context_token_s=1e-5))

    # 1800 context tokens over 6 running sequences: 300 each, 3 ms of attention per sequence. The
    # third worker has not fitted its model yet and does not count towards it.
    demand = decode_demand([report(2, 600, 0.05, 0.010), report(4, 1200, 0.07, 0.012), report(0, 0, 0.0, 0.0)])
    assert demand.step_base_s == pytest.approx(0.06)
    assert demand.step_per_sequence_s == pytest.approx(0.014)
    assert demand.sequences == 6 and demand.batch_per_replica == 2


@pytest.fixture
def api():
    fake = FakeKubeApi()
    fake.replicas.update({"tandem-prefill": 1, "tandem-decode": 1})
    yield fake
    fake.close()


def planner_of(api: FakeKubeApi, registry: WorkerRegistry, identity: str, lease_s: int = 30,
               wall_clock: WallClock | None = None, deployments: dict[Pool, str] | None = None,
               per_version: bool | None = None) -> Planner:
    """An apply-mode planner over `api`; with `deployments`, of a model repository's versions unless
    `per_version` says otherwise."""
    api_client = client.ApiClient(api.configuration())
    scale = DeploymentScale(client.AppsV1Api(api_client), "tandem", deployments or DEPLOYMENTS)
    election = LeaseElection(client.CoordinationV1Api(api_client), "tandem", "tandem-planner", identity, lease_s,
                             wall_clock or WallClock())
    versions = deployments is not None if per_version is None else per_version
    return Planner(registry, CONFIG, scale, election, clock=Clock(), per_version=versions)


def test_apply_sets_the_scale_of_each_pool_from_the_leader_only(api):
    async def scenario() -> None:
        registry = loaded_registry()
        first, second = planner_of(api, registry, "gateway-a"), planner_of(api, registry, "gateway-b")
        registry.workers[0].report.queued_prompt_tokens = 1600  # 1600 / 400 -> 4 prefill replicas
        for planner in (first, second):
            planner.recommend()
            await asyncio.to_thread(planner.apply)
        assert (first.leading, second.leading) == (True, False)
        assert api.leases["tandem-planner"]["spec"]["holderIdentity"] == "gateway-a"
        assert api.patches == [("tandem-prefill", 4), ("tandem-decode", 2)]
        # Already at the recommended counts: nothing more is patched.
        await asyncio.to_thread(first.apply)
        assert len(api.patches) == 2 and first.leading
        await registry.close()

    asyncio.run(scenario())


def test_apply_scales_each_versions_own_deployments_and_leaves_an_unnamed_version_alone(api, caplog):
    """Each version's pools on their own Deployments, as the canary overlay ships them; the fp32
    decode pool is named by no flag, so it is only recommended. No Kubernetes API server can run
    here: the real client scales the Deployments of `FakeKubeApi`, which stands in for one."""
    api.replicas.update({"tandem-prefill-fp32": 1})
    deployments = {(Q4, "prefill"): "tandem-prefill", (Q4, "decode"): "tandem-decode",
                   (FP32, "prefill"): "tandem-prefill-fp32"}

    async def scenario() -> None:
        registry = versioned_registry()
        registry.workers[3].report.used_kv_blocks = 900  # fp32 decode: 900 / 800 -> 2, but not scaled
        planner = planner_of(api, registry, "gateway-a", deployments=deployments)
        planner.recommend()
        with caplog.at_level(logging.INFO, logger="services.gateway.planner"):
            await asyncio.to_thread(planner.apply)
            await asyncio.to_thread(planner.apply)
        assert sorted(api.patches) == [("tandem-decode", 2), ("tandem-prefill-fp32", 4)]
        assert api.replicas == {"tandem-prefill": 1, "tandem-decode": 2, "tandem-prefill-fp32": 4}
        unscaled = [record.getMessage() for record in caplog.records if "recommended only" in record.getMessage()]
        assert unscaled == [f"planner: no Deployment named for the {FP32} decode pool: recommended only"]
        await registry.close()

    asyncio.run(scenario())


def test_apply_scales_the_flexible_shapes_colocated_deployment(api):
    """The flexible overlay with components/planner-apply: its one Deployment, --k8s-colocated."""
    api.replicas.update({"tandem-worker": 1})

    async def scenario() -> None:
        registry = flexible_registry()
        registry.workers[1].report.queued_prompt_tokens = 3000  # behind it a request misses its TTFT 3x
        planner = planner_of(api, registry, "gateway-a", deployments={(None, "colocated"): "tandem-worker"},
                             per_version=False)  # one model, as the flexible overlay runs it
        request = registry.route_request(list(range(300)), max_tokens=100)
        registry.claim(request, registry.decide(request)).release()
        wanted = planner.recommend()[None, "colocated"]
        await asyncio.to_thread(planner.apply)
        assert wanted is not None and wanted >= 4 and api.patches == [("tandem-worker", wanted)]
        await registry.close()

    asyncio.run(scenario())


def test_another_replica_takes_over_an_expired_lease(api):
    async def scenario() -> None:
        registry = loaded_registry()
        wall_clock = WallClock()
        first = planner_of(api, registry, "gateway-a", 1, wall_clock)
        second = planner_of(api, registry, "gateway-b", 1, wall_clock)
        await asyncio.to_thread(first.apply)
        await asyncio.to_thread(second.apply)
        assert (first.leading, second.leading) == (True, False)
        wall_clock.now += datetime.timedelta(seconds=1.2)  # gateway-a stops renewing (gone, or partitioned)
        await asyncio.to_thread(second.apply)
        assert second.leading
        lease = api.leases["tandem-planner"]["spec"]
        assert lease["holderIdentity"] == "gateway-b" and lease["leaseTransitions"] == 1
        await asyncio.to_thread(first.apply)
        assert not first.leading
        await registry.close()

    asyncio.run(scenario())


def test_a_lost_race_for_the_lease_is_not_leading(api):
    class RacedApi(client.CoordinationV1Api):
        """Another replica writes the Lease right after each of our reads."""

        def read_namespaced_lease(self, name, namespace, **kwargs):
            lease = super().read_namespaced_lease(name, namespace, **kwargs)
            api.leases[name]["metadata"]["resourceVersion"] = "999999"
            return lease

    api_client = client.ApiClient(api.configuration())
    assert LeaseElection(client.CoordinationV1Api(api_client), "tandem", "tandem-planner", "gateway-a", 30).try_lead()
    raced = LeaseElection(RacedApi(api_client), "tandem", "tandem-planner", "gateway-a", 30)
    assert not raced.try_lead(), "the write with a stale resourceVersion is refused 409"


def test_apply_mode_needs_both_scale_and_election():
    async def scenario() -> None:
        registry = WorkerRegistry()
        scale = DeploymentScale(client.AppsV1Api(), "tandem", DEPLOYMENTS)
        with pytest.raises(ValueError, match="apply mode"):
            Planner(registry, CONFIG, scale=scale)

    asyncio.run(scenario())
