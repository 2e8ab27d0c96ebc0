"""Where a request runs: pure SLO routing rules over snapshots of the workers' load.

A request is placed on a prefill site P, which computes its prompt, and a decode site D, which
decodes it: aggregated when P is D (one worker), disaggregated when P hands the prompt's KV to D.
A prefill worker is only ever a prefill site and a decode worker a decode site (fixed pools); a
colocated worker is either or both. For every (P, D) the router predicts the request's time to first
token on P and its time per output token on D from each worker's reported step model
(services.common.step_model):

- TTFT = P's queue + P computing the tokens it does not already hold (prefix affinity: the blocks
  its device holds are free, those in its host or disk tier cost their load-back at P's reported
  seconds per block instead of their compute), in chunks beside P's running batch where P decodes
  too, + the hops, + P's recent KV delivery wait when P is not D, + for a request under a LoRA
  adapter, P's load of it when it is not in one of P's slots (services.gateway.adapters: a worker
  holding it ranks first among equally loaded ones; D's own load overlaps P's prompt; a worker
  whose every slot holds other adapters' requests would make it wait for one of them to finish,
  and ranks last, as a worker without KV room does);
- TPOT = one decode step of D's batch with this request added, at the context that batch will hold;
  and where P decodes too, P's running requests see mixed steps while the prompt's chunks run:
  either each stays within the TPOT objective, or the stall they add (the prompts' compute) fits
  within a share (three quarters by default) of the room the running requests have left under
  their mean-TPOT objectives (tpot_slack.py).

A way is feasible when both predictions meet the request's SLO. A decode-role worker prefills
only when no prefill worker can meet the SLO (or, with a policy's share below 1, meet it with room
to spare) (conditional disaggregation: it takes cycles from decoding, and only those its
running requests' TPOT slack allows); otherwise a feasible way on the least loaded decode worker
wins, the cheapest of them (cost: each prediction as a fraction of its objective), aggregated
before disaggregated at equal cost (no KV moves), then in turn. Another colocated worker computes a
prompt only where that gains enough over the decode site's own TTFT (`split_ttft_share`): equal
workers whose step models differ by noise do not trade prompts.
When no way is feasible the router still names the best one, marked as missing the SLO: admission
decides whether to wait for capacity or to run it anyway. Imports neither grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.kv_cache.blocks import blocks_for
from services.common.step_model import StepModel
from services.gateway.adapters import AdapterRef
from services.gateway.routing_policy import DEFAULT_POLICY, RoutingPolicy

Role = Literal["prefill", "decode", "colocated"]
Placement = Literal["aggregated", "disaggregated"]

# Gateway -> decode -> prefill and back, and the first token's relay: a few loopback RPCs.
HOP_S = 0.005
# Added to the cost of a decode worker without KV room for the prompt now; such an option never
# meets the SLO.
NO_ROOM_PENALTY = 100.0


class NoWorkerError(Exception):
    """No worker that could run the request is serving (gRPC health SERVING)."""


@dataclass(frozen=True)
class SloTargets:
    """The objectives a request is routed against, in seconds: what its client asked for
    (request.RequestedSlo) or else the deployment's default."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO objectives must be positive, got ttft {self.ttft_s} s, tpot {self.tpot_s} s")


# The deployment's objectives unless a request or the gateway's flags say otherwise.
DEFAULT_SLO = SloTargets(ttft_s=2.0, tpot_s=0.100)


@dataclass(frozen=True)
class WorkerView:
    """What the gateway knows of one worker when it routes a request (see workers.RemoteWorker.view)."""

    address: str
    role: Role
    serving: bool = True
    queued_prompt_tokens: int = 0
    sequences: int = 0  # running + waiting + reserved: what its decode batch will hold
    context_tokens: int = 0
    free_kv_blocks: int = 0
    block_size: int = field(kw_only=True)  # tokens per KV block, as the worker reports it
    step_model: StepModel = field(default_factory=StepModel)
    chunk_tokens: int = 2048  # the scheduler's token budget per step
    kv_delivery_wait_s: float = 0.0
    # The least stall, in seconds, that any request decoding here can absorb and still meet its
    # TPOT objective (services.gateway.tpot_slack); 0 when unknown.
    tpot_slack_s: float = 0.0
    # What its KV pages mean (kvtransfer.descriptor.KVLayout.page_fingerprint): a prefill worker is
    # paired only with a decode worker whose pages mean the same; "" (a worker that predates it)
    # pairs with any, leaving the refusal to the KV handshake.
    kv_layout: str = ""
    # False for a colocated worker that holds the request's model version only as a retiring one
    # (services.decode.model_swap): it still decodes that version, but its Prefill service computes
    # with its current one, so it is no prefill site for another worker.
    prefills_for_others: bool = True


@dataclass(frozen=True)
class Loadable:
    """Prompt tokens past those on a worker's device that its lower KV tiers hold, by tier: loaded
    back, not computed, in `load_s` seconds."""

    tokens_by_tier: Mapping[str, int]
    load_s: float

    @property
    def tokens(self) -> int:
        return sum(self.tokens_by_tier.values())


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs of a request."""

    prompt_tokens: int
    max_tokens: int
    slo: SloTargets
    # Prompt tokens each worker (by address) holds in its device prefix cache, by the gateway's prefix
    # index (exact, of the workers' block events, or approximate); missing means none.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    # The leading prompt tokens after those that each worker can load back from its host or disk
    # tier; missing means none.
    loadable: Mapping[str, Loadable] = field(default_factory=dict)
    # NAME@VERSION of the model version the request is for: the registry offers the rules only the
    # workers reporting it, so a prefill worker is paired only with a decode worker of that version.
    # None: any worker (a gateway of one model).
    version_key: str | None = None
    # The prompt's block hashes as each worker (by address) names its blocks: the approximate prefix
    # index (services.gateway.approximate_index) records them where the request is placed.
    block_hashes: Mapping[str, Sequence[bytes]] = field(default_factory=dict)
    # The LoRA adapter it runs under (None: the base model): the registry offers the rules only the
    # workers serving it with this fingerprint, so a prefill worker is paired only with a decode
    # worker serving it alike; the seconds each of them (by address) would take to put it in a
    # slot (missing: none); and those whose every slot other adapters' requests hold, where it would
    # wait for one (services.gateway.adapters.waits_for_slot): as a worker without room, last.
    adapter: AdapterRef | None = None
    adapter_load_s: Mapping[str, float] = field(default_factory=dict)
    adapter_slots_full: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Decision:
    """Where to run a request, what the router predicts there, and why."""

    decode: str
    prefill: str | None  # None: the decode worker computes the prompt itself
    ttft_s: float
    tpot_s: float
    meets_slo: bool
    cost: float
    reasons: tuple[str, ...] = ()  # one line per option weighed, the chosen one first

    @property
    def kind(self) -> Placement:
        """Aggregated (the prompt computed where it decodes) or disaggregated (two workers)."""
        return "aggregated" if self.prefill is None else "disaggregated"


def route(request: RouteRequest, workers: Sequence[WorkerView], turn: int = 0,
          policy: RoutingPolicy = DEFAULT_POLICY) -> Decision:
    """The best way to run `request` on these workers (see the module docstring). Raises
    NoWorkerError when no serving worker can decode it or, for decode-only pools, prefill it."""
    decoders = [w for w in workers if w.serving and w.role != "prefill"]
    # Prefill sites for another worker: prefill workers, and colocated ones (beside their own batch).
    prefillers = [w for w in workers if w.serving and w.role != "decode" and w.prefills_for_others
                  and not (policy.keep_prompts_local and w.role == "colocated")]
    if not decoders:
        raise NoWorkerError("no decode or colocated worker is serving")
    # (conditional disaggregation: prefill on a decode-role worker; a split that gains too little;
    # cost, batch, KV moved, queue, turn order)
    options: list[tuple[tuple[bool, bool, float, int, bool, int, int], Decision]] = []
    comfortable = request.slo.ttft_s * policy.remote_ttft_share
    for d_index, decode in enumerate(_rotated(decoders, turn)):
        # A worker without KV room now stays an option, the last resort: it refuses (and the next
        # is tried) or, once admission waited, has room again.
        penalty = 0.0 if _fits(request, decode) and decode.address not in request.adapter_slots_full \
            else NO_ROOM_PENALTY
        tpot = _tpot(request, decode)
        local_ttft = _prefill_ttft(request, decode)
        pairs = [prefill for prefill in prefillers if prefill.address != decode.address and _pairs(prefill, decode)]
        for p_index, prefill in enumerate(_rotated(pairs, turn)):
            ttft = _prefill_ttft(request, prefill) + prefill.kv_delivery_wait_s
            marginal = prefill.role == "colocated" and ttft > policy.split_ttft_share * local_ttft
            decision = _decision(request, decode, prefill, ttft, _disturbed(request, prefill, tpot, policy), penalty)
            options.append(((False, marginal, decision.cost, decode.sequences, True, prefill.queued_prompt_tokens,
                             d_index + p_index), decision))
        decision = _decision(request, decode, None, local_ttft, _disturbed(request, decode, tpot, policy), penalty)
        options.append(((decode.role == "decode" and bool(pairs), False, decision.cost, decode.sequences, False,
                         decode.queued_prompt_tokens, d_index), decision))
    relaxed = not any(d.meets_slo and d.prefill is not None and d.ttft_s <= comfortable for _, d in options)
    options.sort(key=lambda option: _rank(option, relaxed))
    best = options[0][1]
    reasons = tuple(_reason(decision) for _, decision in options[:8])
    return Decision(best.decode, best.prefill, best.ttft_s, best.tpot_s, best.meets_slo, best.cost, reasons)


def slo_use(request: RouteRequest, worker: WorkerView) -> float:
    """How much of its objectives `request` would use placed on `worker` alone: the larger of its
    predicted TTFT and TPOT over their objectives (TTFT alone on a prefill worker); above 1 it misses."""
    ttft = _prefill_ttft(request, worker) / request.slo.ttft_s
    return ttft if worker.role == "prefill" else max(ttft, _tpot(request, worker) / request.slo.tpot_s)


def _rank(option: tuple[tuple[bool, bool, float, int, bool, int, int], Decision], relaxed: bool) -> tuple:
    """Options meeting the SLO first, and among them the least loaded decode worker first, then the
    cheapest; options missing it, the least bad first. Load before cost because a worker whose step
    model is too pessimistic (a start-up profile measured while its neighbours were loading) would
    otherwise get no request while its predictions lost to another's, so no step of its own would
    ever correct them; the SLO, not a few milliseconds of predicted difference, is what must be met.
    A decode worker's own prefill (conditional) ranks after the disaggregated options, unless
    `relaxed` (no prefill worker comfortably within the TTFT objective) and it meets the SLO: then
    it competes on load and cost. A prompt computed by another colocated worker that gains too little
    over the decode site's own (`marginal`) ranks after the others; at equal cost the prompt stays
    where it decodes."""
    (conditional, marginal, cost, sequences, moves_kv, queue, index), decision = option
    if decision.meets_slo:
        conditional = conditional and not relaxed
        return (False, conditional, marginal, sequences, cost, moves_kv, queue, index)
    return (True, conditional, marginal, 0, cost, sequences, moves_kv, queue, index)


def _pairs(prefill: WorkerView, decode: WorkerView) -> bool:
    """Whether the prefill worker's KV pages mean what the decode worker's do (either unknown: yes)."""
    return not prefill.kv_layout or not decode.kv_layout or prefill.kv_layout == decode.kv_layout


def _rotated(workers: list[WorkerView], turn: int) -> list[WorkerView]:
    if not workers:
        return workers
    shift = turn % len(workers)
    return workers[shift:] + workers[:shift]


def _fits(request: RouteRequest, decode: WorkerView) -> bool:
    """The decode worker can reserve the prompt now (it needs the prompt plus one token's blocks)."""
    return blocks_for(request.prompt_tokens + 1, decode.block_size) <= decode.free_kv_blocks


def _uncached(request: RouteRequest, worker: WorkerView) -> int:
    """The prompt tokens `worker` must compute: neither on its device nor loadable from a lower tier
    (the last token always is computed)."""
    return request.prompt_tokens - held_tokens(request, worker.address)


def held_tokens(request: RouteRequest, address: str) -> int:
    """The prompt tokens the worker at `address` need not compute: on its device or loadable."""
    loadable = request.loadable.get(address)
    held = request.cached_tokens.get(address, 0) + (loadable.tokens if loadable is not None else 0)
    return max(0, min(held, request.prompt_tokens - 1))


def _load_s(request: RouteRequest, worker: WorkerView) -> float:
    loadable = request.loadable.get(worker.address)
    return loadable.load_s if loadable is not None else 0.0


def _tpot(request: RouteRequest, decode: WorkerView) -> float:
    """Time per output token in the batch with this request added, halfway through its output
    (one step, over the tokens a step gains where the worker speculates)."""
    context = decode.context_tokens + request.prompt_tokens + request.max_tokens // 2
    return decode.step_model.token_s(decode.sequences + 1, context)


def _prefill_ttft(request: RouteRequest, site: WorkerView) -> float:
    """Time to the first token computing the prompt on `site`: its queue, then the prompt, in chunks
    beside its running batch where it decodes too, and the hops (not the KV's delivery)."""
    model = site.step_model
    chunk = site.chunk_tokens
    sequences, context = (0, 0) if site.role == "prefill" else (site.sequences, site.context_tokens)
    queue = model.prefill_s(site.queued_prompt_tokens, chunk, sequences, context)
    compute = model.prefill_s(_uncached(request, site), chunk, sequences, context)
    slot = request.adapter_load_s.get(site.address, 0.0) + (
        NO_ROOM_PENALTY if site.address in request.adapter_slots_full else 0.0)
    return queue + compute + _load_s(request, site) + slot + HOP_S


def _disturbed(request: RouteRequest, site: WorkerView, tpot: float, policy: RoutingPolicy) -> float:
    """The TPOT to judge a way by when `site` computes the prompt: the request's own `tpot`, or the
    mixed step the site's running requests see meanwhile where they cannot absorb its stall."""
    if site.role == "prefill" or not site.sequences or _absorbed(request, site, policy.tpot_slack_share):
        return tpot
    # The tokens it computes, not the prompt's: a prompt mostly in the site's cache stalls its batch
    # for one short chunk, and counting the whole prompt made a worker holding a conversation's
    # history look as costly as one recomputing it (the next turn then went to the other).
    chunk = min(site.chunk_tokens, _uncached(request, site))
    return max(tpot, site.step_model.step_s(chunk, site.sequences, site.context_tokens))


def _absorbed(request: RouteRequest, site: WorkerView, slack_share: float) -> bool:
    """Whether the requests decoding on `site` can take the stall of its queued prompts and this one
    (their prompt compute, once each) and still meet their mean-TPOT objectives. Only a share of the
    least slack is spent: later arrivals slow the batch's remaining steps, and the step model's
    predictions err."""
    stall = site.step_model.per_prompt_token_s * (site.queued_prompt_tokens + _uncached(request, site))
    return stall <= slack_share * site.tpot_slack_s


def _decision(request: RouteRequest, decode: WorkerView, prefill: WorkerView | None, ttft: float, tpot: float,
              penalty: float) -> Decision:
    slo = request.slo
    meets = ttft <= slo.ttft_s and tpot <= slo.tpot_s and penalty < NO_ROOM_PENALTY
    cost = ttft / slo.ttft_s + tpot / slo.tpot_s + penalty
    return Decision(decode.address, prefill.address if prefill else None, ttft, tpot, meets, cost)


def _reason(decision: Decision) -> str:
    where = f"prefill {decision.prefill} -> decode {decision.decode}" if decision.prefill else \
        f"local prefill on {decision.decode}"
    verdict = "meets SLO" if decision.meets_slo else "misses SLO"
    return (f"{where}: predicted TTFT {decision.ttft_s * 1e3:.0f} ms, TPOT {decision.tpot_s * 1e3:.0f} ms, "
            f"{verdict} (cost {decision.cost:.2f})")
