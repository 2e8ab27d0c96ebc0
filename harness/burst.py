"""Overload: requests with real objectives, many more at once than a mesh can serve within them.
Shared by tests/integration/test_overload.py and the overload suite.

The objectives come from the workers' own step models (services/common/step_model.py), so that they
mean the same on a fast and a slow machine: the TTFT objective is `ttft_factor` times the prefill
worker's predicted compute for one prompt (about that many prompts fit in it at once), the TPOT
objective `tpot_factor` times the decode worker's predicted step for the request alone. Each is met
easily by a request on idle workers, and missed by most of a burst.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from harness.leak_check import load_report
from harness.load_clients import GRPC, HTTP, OK, LoadRequest, Outcome, random_tokens
from harness.mesh import Mesh
from services.common.convert import step_model_from_proto


@dataclass(frozen=True)
class Objectives:
    """A request's latency objectives, in milliseconds."""

    ttft_ms: int
    tpot_ms: int

    def attained(self, outcome: Outcome) -> tuple[bool, bool]:
        """Whether a completed request met (its TTFT objective, its TPOT objective), as its client saw it."""
        if outcome.status != OK or outcome.ttft_s is None:
            return False, False
        tpot_ok = outcome.tpot_s is None or outcome.tpot_s * 1e3 <= self.tpot_ms
        return outcome.ttft_s * 1e3 <= self.ttft_ms, tpot_ok


def objectives(mesh: Mesh, prompt_tokens: int, max_tokens: int, ttft_factor: float = 3.0,
               tpot_factor: float = 4.0) -> Objectives:
    """Objectives for prompts of `prompt_tokens` from the first prefill and decode workers' step models."""
    prefill, decode = load_report(mesh.prefill[0]), load_report(mesh.decode[0])
    prefill_s = step_model_from_proto(prefill.step_model).prefill_s(prompt_tokens, prefill.max_num_batched_tokens)
    step_s = step_model_from_proto(decode.step_model).step_s(0, 1, prompt_tokens + max_tokens)
    return Objectives(max(1, round(ttft_factor * prefill_s * 1e3)), max(1, round(tpot_factor * step_s * 1e3)))


def burst_requests(count: int, prompt_tokens: int, max_tokens: int, slo: Objectives, seed: int) -> list[LoadRequest]:
    """`count` requests with distinct prompts (no prefix cache helps), alternately over gRPC and HTTP."""
    rng = random.Random(seed)
    return [LoadRequest(tuple(random_tokens(rng, prompt_tokens)), max_tokens, (GRPC, HTTP)[i % 2],
                        ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms) for i in range(count)]
