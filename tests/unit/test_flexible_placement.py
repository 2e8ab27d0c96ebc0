"""Where the router places a request among colocated workers, each of which can compute a prompt,
decode it, or both (services.gateway.router), on hand-made load snapshots: aggregated on one worker,
or disaggregated over two, from the predicted TTFT at each prefill site and TPOT at each decode site."""

from __future__ import annotations

import dataclasses

import pytest
from test_router import CPU, decode, request

from services.gateway.router import WorkerView, route
from services.gateway.routing_policy import RoutingPolicy


def colocated(address: str, sequences: int = 0, slack: float = 0.0, queued: int = 0) -> WorkerView:
    return decode(address, sequences=sequences, role="colocated", chunk=512, slack=slack, queued=queued)


def test_idle_colocated_workers_keep_a_prompt_where_it_decodes() -> None:
    decision = route(request(), [colocated("c1"), colocated("c2")])
    assert decision.prefill is None and decision.kind == "aggregated" and decision.meets_slo
    # Its way over two workers was weighed at the same predicted cost, plus the KV's delivery.
    assert any(reason.startswith("prefill c2 -> decode c1") for reason in decision.reasons)


def test_a_busy_worker_holding_the_prefix_computes_the_prompt_for_an_idle_one() -> None:
    # c1 decodes two requests with room under their TPOT objectives and holds 960 of the 1,024
    # prompt tokens: it computes the last 64 and c2, the least loaded, decodes.
    workers = [colocated("c1", sequences=2, slack=5.0), colocated("c2")]
    decision = route(request(1024, cached={"c1": 960}), workers)
    assert (decision.prefill, decision.decode, decision.kind) == ("c1", "c2", "disaggregated")
    assert decision.meets_slo
    uncached_there = CPU.prefill_s(64, 512, 2, 600)
    assert decision.ttft_s == pytest.approx(uncached_there + 0.005)  # c1 delivers at once (wait 0)
    assert decision.tpot_s == pytest.approx(CPU.token_s(1, 1024 + 32))  # c2's batch of one


def test_the_same_request_is_placed_again_as_load_moves() -> None:
    prefix = request(1024, cached={"c1": 960})
    # c1's running requests cannot absorb even 64 prompt tokens' stall, and its mixed steps break
    # their TPOT: c2 computes the whole prompt itself.
    strained = [colocated("c1", sequences=12), colocated("c2")]
    assert route(prefix, strained).kind == "aggregated"
    assert route(prefix, strained).decode == "c2"
    # Once c1's batch has slack again, the prefix it holds makes it the prefill site.
    eased = [colocated("c1", sequences=12, slack=5.0), colocated("c2")]
    assert (route(prefix, eased).prefill, route(prefix, eased).decode) == ("c1", "c2")
    # Behind a long queue of prompts at c1, the prefix no longer pays.
    queued = [colocated("c1", sequences=2, slack=60.0, queued=4000), colocated("c2")]
    assert route(prefix, queued).kind == "aggregated"


def test_a_prefill_site_is_never_its_own_partner_and_fixed_roles_keep_their_side() -> None:
    # A decode-role worker computes prompts only for itself, a prefill-role worker never decodes,
    # and a colocated worker is offered as a prefill site for every other decode site.
    prefill_only = dataclasses.replace(colocated("p1"), role="prefill")
    decode_only = dataclasses.replace(colocated("d1"), role="decode")
    decision = route(request(), [prefill_only, decode_only, colocated("c1")])
    sites = {reason.split(":")[0] for reason in decision.reasons}
    assert sites >= {"prefill p1 -> decode d1", "prefill c1 -> decode d1", "prefill p1 -> decode c1",
                     "local prefill on c1"}
    assert not any(site.startswith(("prefill d1", "local prefill on p1", "prefill c1 -> decode c1"))
                   for site in sites)


def test_equal_workers_do_not_trade_prompts_on_their_step_models_noise() -> None:
    # c1 predicts the prompt 11% sooner, c2 predicts faster decode steps: splitting wins on predicted
    # cost alone, by less than the split's share asks for.
    c1 = dataclasses.replace(colocated("c1"), step_model=dataclasses.replace(CPU, base_s=0.070,
                                                                             per_prompt_token_s=0.0036))
    workers = [c1, colocated("c2")]
    decision = route(request(), workers)
    assert decision.kind == "aggregated" and decision.meets_slo
    split = route(request(), workers, policy=RoutingPolicy(split_ttft_share=1.0))
    assert (split.prefill, split.decode) == ("c1", "c2") and split.cost < decision.cost
    # A prefill site predicted more than twice as fast gains enough.
    workers[0] = dataclasses.replace(c1, step_model=dataclasses.replace(CPU, base_s=0.070, per_prompt_token_s=0.0015))
    assert (route(request(), workers).prefill, route(request(), workers).decode) == ("c1", "c2")


def test_a_fixed_colocated_layout_never_splits_but_a_prefill_pool_still_serves() -> None:
    # The case the flexible router splits (a busy worker holding the prefix computes for an idle
    # one) stays aggregated when the gateway keeps prompts local; a prefill-role worker is still a site.
    fixed = RoutingPolicy(keep_prompts_local=True)
    workers = [colocated("c1", sequences=2, slack=5.0), colocated("c2")]
    decision = route(request(1024, cached={"c1": 960}), workers, policy=fixed)
    assert decision.kind == "aggregated"
    assert not any(reason.startswith("prefill c") for reason in decision.reasons)
    prefill_only = dataclasses.replace(colocated("p1"), role="prefill")
    reasons = route(request(), [prefill_only, colocated("c2")], policy=fixed).reasons
    assert any(reason.startswith("prefill p1 -> decode c2") for reason in reasons)
