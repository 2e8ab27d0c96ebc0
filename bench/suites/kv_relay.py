"""What relaying KV pages through rank 0 costs a tensor-parallel worker, against TP 1 in the same run.

Pages leave and enter a worker with all the model's KV heads (engine.parallel.kv_heads): a prefill
worker at TP N gathers its ranks' heads of each layer's new blocks on rank 0 (one gather a layer,
inside the step), a decode worker at TP N scatters each rank its heads (one scatter a layer). Both
backends send from and receive into rank 0 only; no rank has a KV endpoint of its own.

On the shipped model (real weights, fp32, CPU, one thread a rank), engines in this process with
their other ranks as processes (gloo):

- prefill: a prompt's one step with its pages exported (to a sink that keeps nothing) against the
  same step not exported, at TP 1 and TP --size; the difference is what export costs the step
  (at TP 1 the copy of the blocks; at TP N the copy and the gather);
- decode: importing every layer's pages of a prompt (engine.import_kv) at TP 1 and TP --size
  (at TP N the scatter).

Means over --repeats prompts of --prompt tokens (fresh ones, prefix caching off).

    python -m bench kv_relay [--size 3] [--prompt 512] [--repeats 5] [--quick]

Writes bench/results/kv_relay.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from bench.common.machine import cpu_model, describe
from bench.common.suite import command_line, results_path, suite_parser, write_results
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.kv_connector.export import KVExport, LayerPages
from engine.outputs import KVReservation
from engine.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


class _Discard:
    """A KV sink that keeps nothing: the export's cost without a transfer's."""

    def layer_done(self, layer: int, pages: LayerPages | None) -> None:
        pass


def _prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (tokens,), generator=generator).tolist() for _ in range(count)]


def _prefill_step_s(engine: Engine, prompt: list[int], request_id: str, exported: bool) -> float:
    export = KVExport(_Discard()) if exported else None
    engine.add_request(request_id, prompt, ONE_TOKEN, export=export)
    start = time.perf_counter()
    while not engine.step():
        pass
    seconds = time.perf_counter() - start
    engine.release(request_id)
    return seconds


def measure_prefill(engine: Engine, prompts: list[list[int]]) -> dict[str, float]:
    """Mean step seconds of each prompt exported and not (alternating, after a warm-up of each)."""
    _prefill_step_s(engine, prompts[0], "warm-plain", False)
    _prefill_step_s(engine, prompts[1], "warm-export", True)
    plain, exported = [], []
    for index, prompt in enumerate(prompts[2:]):
        (exported if index % 2 else plain).append(_prefill_step_s(engine, prompt, f"p{index}", bool(index % 2)))
    return {"plain_step_s": sum(plain) / len(plain), "exported_step_s": sum(exported) / len(exported)}


def measure_import(engine: Engine, prompts: list[list[int]]) -> dict[str, float]:
    """Mean seconds to import every layer's pages of a prompt (after one warm-up import)."""
    config = engine.model_config
    page = engine.kv_format.page_shape(engine.kv.block_size, config.num_kv_heads, config.head_dim)
    times = []
    for index, prompt in enumerate(prompts):
        reservation = engine.reserve(f"d{index}", prompt, ONE_TOKEN)
        assert isinstance(reservation, KVReservation)
        blocks = reservation.blocks_to_fill
        pages = torch.randn(len(blocks), *page)
        start = time.perf_counter()
        for layer in range(config.num_layers):
            engine.import_kv(reservation, layer, blocks, pages, pages)
        if index:
            times.append(time.perf_counter() - start)
        engine.abort(f"d{index}")
    return {"import_s": sum(times) / len(times), "bytes": 2 * config.num_layers * pages.nbytes,
            "layers": config.num_layers}


def _engine(role: str, size: int, prompt: int) -> Engine:
    return Engine(EngineConfig(role=role, dtype="float32", quantization="none", cpu_weights="fp32",
                               tensor_parallel_size=size, cache=CacheConfig(num_blocks=prompt // 16 + 8,
                                                                            enable_prefix_caching=False),
                               scheduler=SchedulerConfig(max_num_batched_tokens=max(prompt, 256))))


def main(argv: Sequence[str]) -> int:
    """Both sizes on both sides, the table, the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--size", type=int, default=3, help="ranks of the tensor-parallel workers")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=5, help="prompts measured per case")
    parser.add_argument("--quick", action="store_true", help="a 64-token prompt, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt, args.repeats = 64, 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    prompts = _prompts(2 * args.repeats + 2, args.prompt, seed=args.prompt)
    results: dict = {"command": command_line(__name__, argv), "settings": vars(args), "cpu": cpu_model(),
                     "machine": describe()}
    for size in (1, args.size):
        engine = _engine("prefill", size, args.prompt)
        try:
            results[f"prefill_tp{size}"] = measure_prefill(engine, prompts)
        finally:
            engine.close()
        engine = _engine("decode", size, args.prompt)
        try:
            results[f"decode_tp{size}"] = measure_import(engine, prompts[: args.repeats + 1])
        finally:
            engine.close()
    layers = results["decode_tp1"]["layers"]
    print(f"{args.prompt}-token prompts, fp32 KV, {results['cpu']}; means of {args.repeats}\n")
    print("| side | TP | step not exported (ms) | step exported (ms) | export's cost (ms) | per layer (ms) "
          "| import, all layers (ms) | per layer (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for size in (1, args.size):
        prefill, decode = results[f"prefill_tp{size}"], results[f"decode_tp{size}"]
        cost = prefill["exported_step_s"] - prefill["plain_step_s"]
        print(f"| prefill / decode | {size} | {prefill['plain_step_s'] * 1e3:.1f} | "
              f"{prefill['exported_step_s'] * 1e3:.1f} | {cost * 1e3:.1f} | {cost / layers * 1e3:.2f} | "
              f"{decode['import_s'] * 1e3:.1f} | {decode['import_s'] / layers * 1e3:.2f} |")
    one, many = results["prefill_tp1"], results[f"prefill_tp{args.size}"]
    relay = (many["exported_step_s"] - many["plain_step_s"]) - (one["exported_step_s"] - one["plain_step_s"])
    scatter = results[f"decode_tp{args.size}"]["import_s"] - results["decode_tp1"]["import_s"]
    print(f"\nrelay through rank 0 at TP {args.size} beyond TP 1: gather {relay * 1e3:.1f} ms a prompt "
          f"({relay / many['plain_step_s']:.1%} of its TP {args.size} prefill step), scatter {scatter * 1e3:.1f} ms "
          f"({results['decode_tp1']['bytes'] / 1e6:.1f} MB of pages)")
    results.update({"gather_relay_s": relay, "scatter_relay_s": scatter})
    write_results(results_path(__name__, args.quick), results)
    return 0
