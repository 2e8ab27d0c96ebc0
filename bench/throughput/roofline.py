"""This machine's fp32 roofline for a model: weight-streaming bandwidth and GEMM FLOP/s, measured.

Batch-1 decode has to read every weight once per step, so its floor is weight bytes / bandwidth;
prefill is compute-bound, so its floor is 2 * params * tokens / FLOP/s. Both are measured with
the thread count the systems under test get. The engine_throughput suite runs it in a process of
its own, `python -m bench.throughput.roofline --model-dir DIR [--threads N]`, which prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch
from safetensors import safe_open

_FP32_BYTES = 4


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run`, after one untimed call."""
    run()  # first touch: page faults and library set-up are not what is being measured
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def streaming_bandwidth(num_bytes: int, repeats: int = 5) -> dict[str, float]:
    """Bytes/s reading a `num_bytes` fp32 matrix: as a matrix-vector product (what a batch-1 decode
    step does to each weight) and as a plain sum; the faster of the two is the floor's bandwidth."""
    cols = 1024
    rows = max(1, num_bytes // (_FP32_BYTES * cols))
    matrix = torch.randn(rows, cols)
    vector = torch.randn(cols)
    size = matrix.numel() * _FP32_BYTES
    matvec = size / best_seconds(lambda: torch.mv(matrix, vector), repeats)
    total = size / best_seconds(matrix.sum, repeats)
    return {"matvec_bytes_per_s": matvec, "sum_bytes_per_s": total, "bytes_per_s": max(matvec, total),
            "tensor_bytes": float(size)}


def gemm_flops(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n fp32 matrix product."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    return 2.0 * n**3 / best_seconds(lambda: a @ b, repeats)


def model_parameter_count(model_dir: str) -> int:
    """Parameters of an HF safetensors checkpoint, a tied LM head counted once."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as file:
        tied = bool(json.load(file).get("tie_word_embeddings", False))
    count = 0
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(model_dir, name), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 - safe_open is not iterable
                if tied and key == "lm_head.weight":
                    continue
                numel = 1
                for dim in tensors.get_slice(key).get_shape():
                    numel *= dim
                count += numel
    return count


def measure(model_dir: str, threads: int, stream_bytes: int, gemm_n: int) -> dict[str, float]:
    """Bandwidth, FLOP/s and the model's size, with `threads` torch threads."""
    torch.set_num_threads(threads)
    params = model_parameter_count(model_dir)
    result: dict[str, float] = {"threads": threads, "params": params, "weight_bytes": params * _FP32_BYTES}
    result.update(streaming_bandwidth(stream_bytes))
    result["gemm_flops_per_s"] = gemm_flops(gemm_n)
    result["gemm_n"] = gemm_n
    return result


def main(argv: list[str] | None = None) -> int:
    """Measure with the given flags; print the measurement as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True, help="HF model directory (safetensors)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stream-mib", type=int, default=1280, help="size of the tensor streamed (> 1 GB)")
    parser.add_argument("--gemm-n", type=int, default=2048)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.model_dir, args.threads, args.stream_mib * 1024 * 1024, args.gemm_n)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
