"""The cancellation storm: many requests through a real mesh, many of them cancelled by their
clients at random points, then a check that nothing leaked and the mesh still serves.

Shared by tests/integration/test_cancel_storm.py (200 requests) and the cancel_storm suite (1,000).
Prompts are a few shared prefixes (whole KV blocks) each followed by a unique suffix, so prefix
caches on both pools get hits. A quarter of the clients (by default) use the HTTP API and close their
connection to cancel; the rest use gRPC and cancel the call. Where a cancellation lands:

- `before_prefill`: as soon as the call is sent (it meets the request in the gateway or in the decode
  worker's reservation);
- `during_transfer`: at a random moment before the first token (up to twice the calm time to first
  token). The layer-wise push sends the KV while the prefill computes, so this is while the prefill
  worker computes and sends; the storm counts the prefills that ended undelivered to show it happened;
- `mid_decode`: after a random number of streamed chunks, before the last.
"""

from __future__ import annotations

import random
import statistics
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from tandem.v1 import common_pb2

from harness.leak_check import is_idle, load_report, wait_until_idle
from harness.load_clients import CANCELLED, GRPC, HTTP, OK, LoadRequest, LoadRunner, Outcome, random_tokens
from harness.mesh import Mesh
from harness.worker import WorkerProcess

POINTS = ("before_prefill", "during_transfer", "mid_decode")
# Objectives no request can miss, for a gateway whose load is about cancellation, not admission.
NO_SLO = ("--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000")
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class StormConfig:
    """How many requests, how they look, and how many of them are cancelled."""

    requests: int = 200
    concurrency: int = 8
    cancel_fraction: float = 0.5  # shared equally by the three cancellation points
    http_fraction: float = 0.25
    prefixes: int = 4
    prefix_blocks: int = 4
    suffix_tokens: tuple[int, int] = (4, 40)
    max_tokens: tuple[int, int] = (2, 10)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.prefixes < 1 or self.prefix_blocks < 1:
            raise ValueError("requests, concurrency, prefixes and prefix_blocks must be >= 1")
        for name in ("cancel_fraction", "http_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be within [0, 1], got {getattr(self, name)}")
        low, high = self.suffix_tokens
        if not 1 <= low <= high:
            raise ValueError(f"suffix_tokens: need 1 <= low <= high, got {self.suffix_tokens}")
        low, high = self.max_tokens
        if not 2 <= low <= high:  # mid_decode needs a chunk before the last
            raise ValueError(f"max_tokens: need 2 <= low <= high, got {self.max_tokens}")


@dataclass(frozen=True)
class StormRequest:
    """A planned request and where its client cancels it (None: it runs to the end)."""

    point: str | None
    request: LoadRequest


def plan_storm(config: StormConfig, calm_ttft_s: float) -> list[StormRequest]:
    """The storm's requests in sending order, from `config.seed`; `calm_ttft_s` scales the
    during-transfer delays."""
    rng = random.Random(config.seed)
    prefixes = [random_tokens(rng, config.prefix_blocks * BLOCK_TOKENS) for _ in range(config.prefixes)]
    planned = []
    for _ in range(config.requests):
        prompt = rng.choice(prefixes) + random_tokens(rng, rng.randint(*config.suffix_tokens))
        max_tokens = rng.randint(*config.max_tokens)
        api = HTTP if rng.random() < config.http_fraction else GRPC
        point = rng.choice(POINTS) if rng.random() < config.cancel_fraction else None
        cancel = {
            None: {},
            "before_prefill": {"cancel_after_s": 0.0},
            "during_transfer": {"cancel_after_s": rng.uniform(0.0, 2.0 * calm_ttft_s)},
            "mid_decode": {"cancel_after_chunks": rng.randint(1, max_tokens - 1)},
        }[point]
        planned.append(StormRequest(point, LoadRequest(tuple(prompt), max_tokens, api, **cancel)))
    return planned


@dataclass
class StormReport:
    """What the storm did and what it left behind."""

    planned: list[StormRequest]
    outcomes: list[Outcome]
    seconds: float
    idle_reports: list[common_pb2.LoadReport]
    served_before: list[int]
    served_after: list[int]
    prefix_hit_tokens: float
    prefills_undelivered: int  # prefills the workers ended without delivering their KV (cancelled)
    counts: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        for planned, outcome in zip(self.planned, self.outcomes, strict=True):
            self.counts[(planned.point or "none", outcome.request.api, outcome.status)] += 1

    def problems(self) -> list[str]:
        """Everything that went wrong; empty when the storm passed."""
        found = outcome_problems(self.outcomes)
        held = [f"{r.worker_id}: used_kv_blocks={r.used_kv_blocks} running={r.running_requests} "
                f"waiting={r.waiting_requests} reserved={r.reserved_requests}"
                for r in self.idle_reports if not is_idle(r)]
        found += [f"leaked: {line}" for line in held]
        if self.served_after != self.served_before:
            found.append(f"after the storm the mesh answered {self.served_after}, before it {self.served_before}")
        if not self.prefix_hit_tokens:
            found.append("no prefix cache hit: the shared prefixes were never reused")
        if not self.prefills_undelivered:
            found.append("no cancellation landed while a prefill worker computed or sent the KV")
        return found

    def summary(self) -> str:
        """A few lines for people: counts by cancellation point, API and outcome."""
        cancelled = sum(1 for o in self.outcomes if o.status == CANCELLED)
        lines = [f"{len(self.outcomes)} requests in {self.seconds:.1f} s: {cancelled} cancelled by their clients, "
                 f"{sum(1 for o in self.outcomes if o.status == OK)} completed; prefix cache hits "
                 f"{self.prefix_hit_tokens:.0f} tokens; prefills ended undelivered {self.prefills_undelivered}"]
        for (point, api, status), count in sorted(self.counts.items()):
            lines.append(f"  cancel={point:<16} api={api:<5} outcome={status:<10} {count}")
        return "\n".join(lines)


def outcome_problems(outcomes: list[Outcome]) -> list[str]:
    """Requests that failed (anything but completing or being cancelled by their client), and completed
    ones without exactly their `max_tokens` tokens."""
    found = []
    for index, outcome in enumerate(outcomes):
        if outcome.status not in (OK, CANCELLED):
            found.append(f"request {index} ({outcome.request.api}): {outcome.status} {outcome.detail}")
        elif outcome.status == OK and outcome.tokens != outcome.request.max_tokens:
            found.append(f"request {index} ({outcome.request.api}) completed with {outcome.tokens} tokens, "
                         f"not {outcome.request.max_tokens}")
    return found


def calm_ttft(runner: LoadRunner, config: StormConfig, samples: int = 3) -> float:
    """The median time to first token of uncancelled requests sent one at a time (the first, which
    pairs the workers, is not counted)."""
    rng = random.Random(config.seed + 1)
    ttfts = []
    for _ in range(samples + 1):
        prompt = random_tokens(rng, config.prefix_blocks * BLOCK_TOKENS + config.suffix_tokens[1])
        outcome = runner.run(LoadRequest(tuple(prompt), 2))
        if outcome.status != OK or outcome.ttft_s is None:
            raise RuntimeError(f"a calm request failed: {outcome}")
        ttfts.append(outcome.ttft_s)
    return statistics.median(ttfts[1:])


def run_storm(mesh: Mesh, config: StormConfig) -> StormReport:
    """Calibrate, run the storm against `mesh`, wait for the workers to go idle and check again
    that the mesh serves; the report (see `StormReport.problems`)."""
    with LoadRunner(str(mesh.gateway.address), str(mesh.gateway.http_address)) as runner:
        ttft_s = calm_ttft(runner, config)
        probe = LoadRequest(tuple(random_tokens(random.Random(config.seed + 2), 48)), 8)
        served_before = _greedy(runner, probe)
        hits_before = _counter(mesh.workers, "vllm:prefix_cache_hits_total")
        prefill_before = _prefill_ends(mesh)
        planned = plan_storm(config, ttft_s)
        started = time.monotonic()
        outcomes = runner.run_all([p.request for p in planned], config.concurrency)
        seconds = time.monotonic() - started
        idle_reports = wait_until_idle(mesh.workers)
        prefill_after = _prefill_ends(mesh)
        return StormReport(
            planned, outcomes, seconds, idle_reports, served_before, _greedy(runner, probe),
            _counter(mesh.workers, "vllm:prefix_cache_hits_total") - hits_before,
            (prefill_after[0] - prefill_before[0]) - int(prefill_after[1] - prefill_before[1]),
        )


def _greedy(runner: LoadRunner, request: LoadRequest) -> list[int]:
    """The request's greedy token ids through the gRPC API (grpc.RpcError if it fails)."""
    ids: list[int] = []
    for chunk in runner.client.generate(token_ids=list(request.token_ids), max_tokens=request.max_tokens,
                                        temperature=0.0, ignore_eos=True, timeout=300):
        ids.extend(chunk.token_ids)
    return ids


def _prefill_ends(mesh: Mesh) -> tuple[int, float]:
    """(prefill requests ended for any reason, prefills delivered) summed over the prefill workers."""
    ended = sum(load_report(worker).finished_requests for worker in mesh.prefill)
    return ended, _counter(mesh.prefill, "vllm:time_to_first_token_seconds_count")


def _counter(workers: list[WorkerProcess], sample: str) -> float:
    """A Prometheus sample summed over the workers' /metrics."""
    total = 0.0
    for worker in workers:
        with urllib.request.urlopen(f"http://{worker.metrics_address}/metrics", timeout=30) as response:
            text = response.read().decode()
        total += sum(s.value for family in text_string_to_metric_families(text)
                     for s in family.samples if s.name == sample)
    return total
