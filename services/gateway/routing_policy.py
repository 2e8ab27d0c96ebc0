"""The router's policy knobs (gateway flags, generated from this config): how much of the
objectives' room it spends on a decode worker's own prefills, and whether colocated workers trade
prompts (services.gateway.router applies them)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config_flags import flag


@dataclass(frozen=True)
class RoutingPolicy:
    """How much of the objectives' room the router spends on a decode worker's own prefills."""

    # A prefill worker predicted to reach the first token within this share of the TTFT objective
    # keeps the prompt from a decode worker; above it a decode worker with slack may take the prompt,
    # if that is cheaper. At 1 a decode worker prefills only when no prefill worker meets the
    # objective: a lower share kept no more requests within their SLO (`python -m bench goodput`;
    # docs/benchmarks.md, "Decisions settled by experiments").
    remote_ttft_share: float = flag(
        1.0, "a decode worker whose running requests' TPOT slack allows it computes a prompt itself once every "
        "prefill worker's predicted TTFT exceeds this share of the objective, if that is sooner (1: only when no "
        "prefill worker meets it)")
    # The share of its running requests' least TPOT slack a worker may spend on stalling them with
    # prompts: later arrivals slow the batch's remaining steps, and the step model's predictions err.
    # Less refused requests that would have met their SLO, and this much still kept TPOT within the
    # objective (`python -m bench goodput`; docs/benchmarks.md, "Decisions settled by experiments").
    tpot_slack_share: float = flag(
        0.75, "share of its running requests' least TPOT slack (the room left under their objectives) a worker "
        "may spend stalling them with a prompt")

    # Moving a prompt's KV between two colocated workers is not free (both hold it, the link
    # carries it) and two workers' step models disagree by their own noise: another colocated
    # worker computes a prompt only when its predicted TTFT is within this share of the decode
    # site's own (not measured: a guard, so that equal workers do not trade prompts on noise).
    split_ttft_share: float = flag(
        0.8, "a colocated worker computes a prompt for another worker only when its predicted TTFT, the KV's "
        "delivery included, is within this share of what the decode site itself would take")

    # Fixed layouts stay possible beside the flexible one: a colocated pool whose workers never
    # trade prompts is the aggregated baseline the flexible placement must beat.
    keep_prompts_local: bool = flag(
        False, "a colocated worker computes only the prompts it decodes itself, never one for another worker: "
        "the fixed colocated layout (default: flexible, each request placed aggregated or split)")

    def __post_init__(self) -> None:
        for name in ("remote_ttft_share", "tpot_slack_share", "split_ttft_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}: must be in (0, 1], got {getattr(self, name)}")


DEFAULT_POLICY = RoutingPolicy()
