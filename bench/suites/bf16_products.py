"""bf16 products on a CPU with AVX512-BF16: the kernels' two GEMMs over pairs (vdpbf16ps, fp32 FMAs)
against oneDNN's packed GEMM.

For the shipped model's product shapes (fused qkv, o, fused gate/up and down of one decoder layer,
30 copies each, and the LM head once, as a decode step reads them: each weight streaming from
memory, not reused from cache), at each of `--rows` rows: the seconds of one pass over all of them
through `bf16_gemm` and `bf16_gemm_fma` (engine/model/kernels/bf16_gemm.cpp, weights packed by
`pack_bf16_pairs`) and through `torch.ops.mkldnn._linear_pointwise` over `_reorder_linear_weight`'s
copy (what QuantizedLinear serves past the vdpbf16ps GEMM's rows, and everywhere on AMX). The best of
`--repeat` passes, the three alternated; random bf16 weights of the model's shapes. The engine picks
one of the kernels' two at start-up by timing both (engine/model/kernels/bf16_choice.py): the line
after the table says which it picks here.

    python -m bench bf16_products [--rows 4,8,16,32,64,128,256,2048] [--repeat 5] [--threads 1]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from bench.common.machine import describe
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.throughput.roofline import best_seconds
from engine.model.kernels import kernels, pack_bf16_pairs

# (output columns, K, copies): the shipped model's per-layer products over 30 layers, and its LM head.
SHAPES = ((960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1))


def measure(rows: Sequence[int], repeat: int) -> list[dict]:
    """One entry per row count: seconds per pass through each GEMM, and oneDNN's over each of ours."""
    ops = kernels()
    gemms = {"bf16_gemm": ops.bf16_gemm, "bf16_gemm_fma": ops.bf16_gemm_fma}
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).bfloat16() for _ in range(copies)] for n, k, copies in SHAPES]
    pairs = [[pack_bf16_pairs(w) for w in ws] for ws in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] for ws in weights]
    del weights
    entries = []
    for m in rows:
        inputs = [torch.randn(m, k, generator=gen).bfloat16() for _, k, _ in SHAPES]

        def ours(gemm, inputs: list[torch.Tensor] = inputs) -> None:
            for (n, _, _), x, ws in zip(SHAPES, inputs, pairs, strict=True):
                for w in ws:
                    gemm(x, w, n, None, False)

        def theirs(inputs: list[torch.Tensor] = inputs) -> None:
            for x, ws in zip(inputs, onednn, strict=True):
                for w in ws:
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        runs = {name: functools.partial(ours, gemm) for name, gemm in gemms.items()} | {"onednn": theirs}
        seconds = dict.fromkeys(runs, float("inf"))
        for _ in range(2):  # alternated, so a slow spell of the machine falls on all three
            for name, run in runs.items():
                seconds[name] = min(seconds[name], best_seconds(run, repeat))
        flops = sum(2 * m * n * k * copies for n, k, copies in SHAPES)
        entry: dict = {"rows": m}
        for name, s in seconds.items():
            entry[f"{name}_ms"], entry[f"{name}_gflops"] = s * 1e3, flops / s / 1e9
        entry["speedup"] = seconds["onednn"] / seconds["bf16_gemm"]
        entry["fma_speedup"] = seconds["onednn"] / seconds["bf16_gemm_fma"]
        entries.append(entry)
        print(f"{m:>5} rows: " + "   ".join(f"{name} {entry[name + '_ms']:8.1f} ms ({entry[name + '_gflops']:4.0f} "
                                            f"GFLOP/s)" for name in runs)
              + f"   oneDNN / vdpbf16ps {entry['speedup']:.2f}x, oneDNN / FMA {entry['fma_speedup']:.2f}x", flush=True)
    return entries


def main(argv: Sequence[str]) -> int:
    """Print the table; write the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--rows", default="4,8,16,32,64,128,256,2048")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    if kernels().bf16_gemm is None:
        print("bf16_products: nothing to compare here: the kernels' bf16 GEMM serves only CPUs with avx512_bf16 "
              "and without AMX")
        return 0
    torch.set_num_threads(args.threads)
    start = load_average()
    entries = measure([int(r) for r in args.rows.split(",")], args.repeat)
    chosen = kernels().bf16_products
    print(f"- the engine's start-up choice here: the {chosen.instruction} GEMM (probe: vdpbf16ps "
          f"{chosen.gflops[0]:.0f} GFLOP/s, FMA {chosen.gflops[1]:.0f})")
    machine = describe()
    print(f"- {machine['processor']} ({', '.join(machine['isa'])}), {args.threads} thread(s); "
          f"load average {start} → {load_average()}")
    write_results(args.out, {"command": command_line(__name__, argv), "machine": machine, "threads": args.threads,
                             "chosen": chosen.instruction, "entries": entries})
    return 0
