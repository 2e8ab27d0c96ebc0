"""`tandem advise`: how many workers a workload needs and how much of its prompt work to
disaggregate, from a worker's measured step model and a trace (services.gateway.advice).

The step model is read from a running decode or colocated worker's load report (tandem.v1.Decode's
GetLoad: `--worker`, the model it fitted from the steps it ran: give it some traffic first) or given
as JSON (`--step-model`, the fields of services.common.step_model.StepModel). The trace is JSON lines
with `prompt_tokens` and `output_tokens` per request (`python -m bench goodput` writes its workload's
as bench/results/goodput-WORKLOAD-trace.jsonl). With `--rate` the
report is the smallest pool that meets the objectives at that rate; without, the most each pool
size serves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from services.commands.security_flags import TlsFlags
from services.common.config_flags import add_flags, flag, from_args
from services.common.step_model import StepModel
from services.gateway.advice import Layout, TraceShape, capacity, workers_needed
from services.gateway.router import SloTargets


@dataclass(frozen=True)
class AdviseFlags:
    """The flags of `tandem advise`: one field per flag."""

    trace: str = flag("", "JSON lines, one request each with prompt_tokens and output_tokens (required)")
    worker: str | None = flag(None, "HOST:PORT of a running decode or colocated worker whose fitted step model "
                                    "to use")
    step_model: str | None = flag(None, "the step model as JSON (StepModel's fields), instead of --worker")
    chunk_tokens: int | None = flag(None, "prompt tokens a step computes at most (default: the worker's "
                                          "--max-num-batched-tokens, or 2048)")
    rate: float | None = flag(None, "requests/s to plan for (default: the most each pool size serves)")
    ttft_ms: float = flag(2000.0, "the TTFT objective, at the trace's 90th-percentile prompt")
    tpot_ms: float = flag(100.0, "the TPOT objective")
    max_workers: int = flag(8, "the largest pool considered")
    tls: TlsFlags = dataclasses.field(default_factory=TlsFlags)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `advise` subcommand."""
    advise = sub.add_parser("advise", help="workers needed and the share of prompts to disaggregate, from a "
                                           "worker's step model and a trace")
    add_flags(advise, AdviseFlags)
    advise.set_defaults(func=run)


def read_trace(path: str) -> TraceShape:
    """The trace's shape; ValueError naming the line of a malformed request."""
    requests = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                requests.append((int(record["prompt_tokens"]), int(record["output_tokens"])))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"--trace {path}:{number}: expected prompt_tokens and output_tokens "
                                 f"({error})") from None
    return TraceShape.of(requests)


def _worker_load(address: str, tls: TlsFlags) -> tuple[StepModel, int]:
    """The worker's fitted step model and its --max-num-batched-tokens, from GetLoad."""
    import asyncio

    from tandem.v1 import common_pb2, decode_pb2_grpc

    from services.common.channels import Channels
    from services.common.convert import step_model_from_proto

    async def ask() -> common_pb2.LoadReport:
        async with Channels(tls.config()).open(address) as channel:
            return await decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=10.0)

    report = asyncio.run(ask())
    return step_model_from_proto(report.step_model), report.max_num_batched_tokens


def _row(layout: Layout) -> str:
    return (f"{layout.workers} workers: {layout.workers - layout.prefilling} decoding, {layout.prefilling} "
            f"computing prompts for them, {layout.disaggregated_share:.0%} of prompts disaggregated; predicted "
            f"TTFT p90 {layout.ttft_s * 1e3:,.0f} ms, TPOT {layout.tpot_s * 1e3:.1f} ms")


def run(args: argparse.Namespace) -> int:
    """Print the advice; 1 when no pool of at most --max-workers meets the objectives."""
    flags: AdviseFlags = from_args(AdviseFlags, args)
    if not flags.trace:
        raise ValueError("--trace: a trace is required")
    if (flags.worker is None) == (flags.step_model is None):
        raise ValueError("--worker or --step-model: give one")
    chunk = 2048
    if flags.worker is not None:
        model, chunk = _worker_load(flags.worker, flags.tls)
    else:
        try:
            model = StepModel(**json.loads(str(flags.step_model)))
        except (ValueError, TypeError) as error:
            raise ValueError(f"--step-model: {error}") from None
    if not model.known:
        raise ValueError("the step model is empty: the worker has run no step yet")
    chunk = flags.chunk_tokens or chunk
    trace = read_trace(flags.trace)
    objectives = SloTargets(flags.ttft_ms / 1e3, flags.tpot_ms / 1e3)
    print(f"step model: {model}\ntrace: prompts mean {trace.prompt_mean:.0f} (p90 {trace.prompt_p90:.0f}), outputs "
          f"mean {trace.output_mean:.0f} tokens; objectives TTFT {flags.ttft_ms:g} ms, TPOT {flags.tpot_ms:g} ms")
    if flags.rate is not None:
        layout = workers_needed(model, trace, flags.rate, objectives, chunk, flags.max_workers)
        print(f"at {flags.rate:g} req/s: " + (_row(layout) if layout else f"no pool of up to {flags.max_workers} "
                                               "workers meets the objectives"))
        return 0 if layout else 1
    for workers in range(1, flags.max_workers + 1):
        rate, layout = capacity(model, trace, workers, objectives, chunk)
        print(f"up to {rate:.2f} req/s: " + (_row(layout) if layout else f"{workers} workers meet the objectives "
                                             "at no rate"))
    return 0
