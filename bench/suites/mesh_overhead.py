"""What the mesh costs a request, and how much of the KV transfer its layer-wise push hides.

Three phases run one after another, never at the same time, so they never compete for the CPUs:

1. Mesh: a gateway, a prefill and a decode worker (each its own process, one torch thread); the
   requests go one after another through services.client.TandemClient. TTFT is measured at the client
   (start of the call to the first chunk carrying a token); TPOT is (last token - first token) / (n - 1).
2. In-process: the same engine in a child process with one torch thread, the same prompts one by one
   through engine.offline.generate.
3. Transfer: one prompt's KV sent on its own through the chosen backend, by the kv_transfer suite's
   sender and receiver (bench/common/kv_rig.py; the median of --transfer-runs transfers after a warm-up).

Each side first runs one untimed warm-up request. Prompts are distinct random token ids, so that no
request hits a prefix cache. Hidden fraction of the transfer = 1 - (mesh TTFT - in-process TTFT) / transfer
time, clamped to [0, 1]: everything the mesh adds (gRPC hops included) counts as unhidden transfer, so
it is a lower bound. The direct measure uses the prefill worker's delivery wait (from its first token
to the receiver holding every page, reported in each request's timings): the transfer time compute
did not hide, so hidden = 1 - delivery wait / transfer time.

    python -m bench mesh_overhead [--requests 8] [--prompt-tokens 512] [--output-tokens 64]
                                  [--kv-backend torch_dist|grpc] [--quick]

Writes bench/results/mesh_overhead.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

from bench.common import kv_rig
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from harness.load_clients import random_tokens
from harness.token_timer import TokenTimer
from harness.worker import WorkerProcess, start_worker

TTFT_TARGET = 1.10
TPOT_TARGET = 1.05
HIDDEN_TARGET = 0.80


@dataclass(frozen=True)
class RequestTiming:
    """One timed request; the worker timings only come from the mesh."""

    ttft_s: float
    tpot_s: float
    tokens: int
    kv_wait_s: float | None = None
    prefill_compute_s: float | None = None
    delivery_wait_s: float | None = None


def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` distinct prompts of `length` random token ids."""
    rng = random.Random(seed)
    return [random_tokens(rng, length) for _ in range(count)]


# ---- phase 1: the mesh --------------------------------------------------------------------------------
def mesh_request(client, prompt: list[int], output_tokens: int) -> RequestTiming:
    """Send one request through the gateway and time it at the client."""
    clock = TokenTimer()
    timings = None
    for chunk in client.generate(token_ids=prompt, max_tokens=output_tokens, temperature=0.0, ignore_eos=True):
        clock.add(len(chunk.token_ids))
        timings = chunk.timings or timings
    if clock.tokens != output_tokens or clock.ttft_s is None or clock.tpot_s is None:
        raise RuntimeError(f"the mesh generated {clock.tokens} tokens, not {output_tokens}")
    return RequestTiming(
        ttft_s=clock.ttft_s,
        tpot_s=clock.tpot_s,
        tokens=clock.tokens,
        kv_wait_s=timings.kv_wait_s if timings else None,
        prefill_compute_s=timings.prefill_compute_s if timings else None,
        delivery_wait_s=timings.kv_delivery_wait_s if timings else None,
    )


def run_mesh(prompts: list[list[int]], output_tokens: int, backend: str) -> list[RequestTiming]:
    """Start the three processes, time every prompt but the first (the warm-up), stop them."""
    from services.client import TandemClient

    workers: list[WorkerProcess] = []
    try:
        # Both workers load their model at the same time; the gateway needs their addresses.
        workers.append(start_worker(["prefill", "--port", "0", "--threads", "1"], wait=False))
        workers.append(start_worker(["decode", "--port", "0", "--threads", "1", "--kv-backend", backend], wait=False))
        prefill, decode = (worker.wait_ready() for worker in workers)
        workers.append(start_worker(["gateway", "--port", "0", "--http-port", "0",
                                     "--prefill", prefill, "--decode", decode]))
        with TandemClient(str(workers[-1].address)) as client:
            timed = [mesh_request(client, prompt, output_tokens) for prompt in prompts]
    finally:
        for worker in reversed(workers):
            if worker.stop() != 0:
                print(f"warning: {worker.args[0]} exited uncleanly; log:\n{worker.log_tail()}", file=sys.stderr)
    return timed[1:]


# ---- phase 2: the same engine in-process --------------------------------------------------------------
def inprocess_child(conn: Connection, prompts: list[list[int]], output_tokens: int) -> None:
    """Send back (timings of every prompt but the first, the engine's KV shape)."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.offline import generate
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    # The workers' defaults (512 MiB of KV, prefix caching on), in the colocated role.
    engine = Engine(EngineConfig())
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    timed = []
    for prompt in prompts:
        (completion,) = generate(engine, [prompt], params)
        if len(completion.token_ids) != output_tokens:
            raise RuntimeError(f"the engine generated {len(completion.token_ids)} tokens, not {output_tokens}")
        timed.append(RequestTiming(completion.ttft_s, completion.tpot_s, len(completion.token_ids)))
    config = engine.model_config
    shape = {"num_layers": config.num_layers, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
             "dtype": engine.formats.kv_cache_dtype, "block_size": engine.kv.block_size}
    conn.send(([asdict(t) for t in timed[1:]], shape))


def run_inprocess(prompts: list[list[int]], output_tokens: int) -> tuple[list[RequestTiming], dict]:
    ctx = multiprocessing.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=inprocess_child, args=(child_end, prompts, output_tokens))
    child.start()
    child_end.close()
    try:
        timed, shape = conn.recv()
    except EOFError:
        child.join(30)
        raise RuntimeError(f"the in-process baseline died (exit code {child.exitcode})") from None
    child.join(60)
    return [RequestTiming(**t) for t in timed], shape


# ---- phase 3: the transfer on its own -----------------------------------------------------------------
def run_transfer(backend: str, runs: int) -> float:
    """Median seconds of one 512-token prompt's KV through `backend`, as the kv_transfer suite times it."""
    import torch

    from kvtransfer.receiver import make_receiver

    torch.set_num_threads(1)
    ctx = multiprocessing.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=kv_rig.sender_process, args=(child_end,), daemon=True)
    child.start()
    if backend == "torch_dist":
        receiver = make_receiver("torch_dist", "127.0.0.1", "", timeout=60.0)
        stop_server = None
    else:
        receiver, stop_server = kv_rig.serve_grpc()
    try:
        run = kv_rig.BackendRun(conn, receiver)
        seconds = [run.once() for _ in range(runs)]
    finally:
        conn.send(("exit",))
        child.join(30)
        receiver.close()
        if stop_server:
            stop_server()
    return statistics.median(seconds)


# ---- report -------------------------------------------------------------------------------------------
def median(timed: list[RequestTiming], name: str) -> float:
    return statistics.median(getattr(t, name) for t in timed)


def hidden(unhidden_s: float, transfer_s: float) -> float:
    return min(1.0, max(0.0, 1.0 - unhidden_s / transfer_s))


def summarize(mesh: list[RequestTiming], local: list[RequestTiming], transfer_s: float, transfer_note: str) -> dict:
    """Medians over requests, their ratios and both views of the hidden transfer."""
    ttft_mesh, ttft_local = median(mesh, "ttft_s"), median(local, "ttft_s")
    tpot_mesh, tpot_local = median(mesh, "tpot_s"), median(local, "tpot_s")
    kv_waits = [t.kv_wait_s for t in mesh if t.kv_wait_s is not None]
    kv_wait = statistics.median(kv_waits) if kv_waits else None
    delivery_waits = [t.delivery_wait_s for t in mesh if t.delivery_wait_s is not None]
    delivery_wait = statistics.median(delivery_waits) if delivery_waits else None
    return {
        "ttft_s": {"in_process": ttft_local, "mesh": ttft_mesh, "ratio": ttft_mesh / ttft_local},
        "tpot_s": {"in_process": tpot_local, "mesh": tpot_mesh, "ratio": tpot_mesh / tpot_local},
        "transfer_s": transfer_s,
        "transfer_note": transfer_note,
        "mesh_extra_ttft_s": ttft_mesh - ttft_local,
        "hidden_by_ttft": hidden(ttft_mesh - ttft_local, transfer_s),
        "kv_wait_s": kv_wait,
        "delivery_wait_s": delivery_wait,
        "hidden_by_delivery_wait": hidden(delivery_wait, transfer_s) if delivery_wait is not None else None,
        "prefill_compute_s": median(mesh, "prefill_compute_s") if all(t.prefill_compute_s is not None
                                                                    for t in mesh) else None,
    }


def print_table(args: argparse.Namespace, s: dict, loads: dict[str, str]) -> None:
    print(f"\n{args.requests} requests one after another, {args.prompt_tokens}-token prompts, "
          f"{args.output_tokens} output tokens, greedy, kv backend {args.kv_backend}; medians over requests")
    print(f"load average: {loads['start']} (start), {loads['end']} (end)\n")
    print(f"| {'figure':<34} | {'in-process':>10} | {'mesh':>10} | {'ratio':>6} | target  |")
    print(f"|{'-' * 36}|{'-' * 12}|{'-' * 12}|{'-' * 8}|---------|")
    for name, target in (("ttft_s", TTFT_TARGET), ("tpot_s", TPOT_TARGET)):
        row = s[name]
        print(f"| {name[:4].upper() + ' (ms)':<34} | {row['in_process'] * 1e3:>10.1f} | {row['mesh'] * 1e3:>10.1f} "
              f"| {row['ratio']:>5.2f}x | <= {target:.2f}x |")
    print(f"\nKV transfer alone ({args.kv_backend}, {s['transfer_note']}): {s['transfer_s'] * 1e3:.1f} ms")
    print(f"mesh TTFT - in-process TTFT: {s['mesh_extra_ttft_s'] * 1e3:.1f} ms")
    print(f"hidden fraction = 1 - (mesh TTFT - in-process TTFT) / transfer, clamped to [0, 1] "
          f"(counts all mesh overhead as unhidden transfer: a lower bound): {s['hidden_by_ttft']:.0%} "
          f"(target >= {HIDDEN_TARGET:.0%})")
    if s["delivery_wait_s"] is not None:
        print(f"prefill worker's delivery wait (first token -> every page delivered): "
              f"{s['delivery_wait_s'] * 1e3:.1f} ms; hidden = 1 - delivery wait / transfer: "
              f"{s['hidden_by_delivery_wait']:.0%} (target >= {HIDDEN_TARGET:.0%})")
    if s["kv_wait_s"] is not None:
        print(f"decode worker's kv_wait (prefill reply -> KV complete): {s['kv_wait_s'] * 1e3:.1f} ms")
    if s["prefill_compute_s"] is not None:
        print(f"prefill worker's compute time: {s['prefill_compute_s'] * 1e3:.1f} ms")


def main(argv: Sequence[str]) -> int:
    """The three phases in turn, the table, the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--requests", type=int, default=8, help="timed requests per side (after one warm-up)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kv-backend", default="torch_dist", choices=["torch_dist", "grpc"])
    parser.add_argument("--transfer-runs", type=int, default=5, help="timed transfers in phase 3")
    parser.add_argument("--quick", action="store_true", help="2 requests, 16 output tokens, 2 transfers")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.output_tokens, args.transfer_runs = 2, 16, 2
    if args.output_tokens < 2:
        parser.error("--output-tokens must be at least 2 (TPOT needs two tokens)")
    os.environ["OMP_NUM_THREADS"] = "1"
    prompts = make_prompts(args.requests + 1, args.prompt_tokens)
    loads = {"start": load_average()}

    print(f"phase 1/3: mesh ({args.kv_backend}) ...", flush=True)
    mesh = run_mesh(prompts, args.output_tokens, args.kv_backend)
    loads["after_mesh"] = load_average()
    print("phase 2/3: in-process engine ...", flush=True)
    local, shape = run_inprocess(prompts, args.output_tokens)
    loads["after_in_process"] = load_average()
    print("phase 3/3: KV transfer alone ...", flush=True)
    transfer_s = run_transfer(args.kv_backend, args.transfer_runs)
    loads["end"] = load_average()

    layout = kv_rig.LAYOUT
    bench_shape = {name: getattr(layout, name) for name in shape}
    if bench_shape != shape:
        print(f"warning: the kv_transfer suite's KV shape {bench_shape} is not the engine's {shape}", file=sys.stderr)
    note = f"{kv_rig.TOTAL_BYTES / 1e6:.1f} MB, {kv_rig.PROMPT_TOKENS} tokens"
    if args.prompt_tokens != kv_rig.PROMPT_TOKENS:
        # The rig sends 512 tokens' worth; time grows with the bytes.
        transfer_s *= args.prompt_tokens / kv_rig.PROMPT_TOKENS
        note += f", scaled linearly to {args.prompt_tokens} tokens"

    summary = summarize(mesh, local, transfer_s, note)
    print_table(args, summary, loads)
    write_results(results_path(__name__, args.quick), {
        "command": command_line(__name__, argv),
        "settings": vars(args), "load_average": loads, "engine_kv_shape": shape, "summary": summary,
        "mesh": [asdict(t) for t in mesh], "in_process": [asdict(t) for t in local],
    })
    return 0
