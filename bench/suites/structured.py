"""What a JSON-schema constraint costs a request: decode TPOT constrained against free at batch 1 and
32, and the TTFT a cold and a cached compile of its grammar add.

One in-process engine in this checkout's default formats, `--threads` torch threads. Decode: a
batch of B chat requests asking for a list of records, constrained by a schema whose array cannot
close within the tokens generated (so every request decodes all of them, as the free ones with
ignore_eos do), timed step by step after the prompts; the two configurations alternate `--repeats`
times and the medians are compared. TTFT: one request alone, free, with a schema compiled before
(cached), and with a schema never seen (cold: a new property name each time).

    python -m bench structured [--threads 1] [--batches 1,32] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence

import torch

from bench.common.machine import describe
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput

RECORD = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "population": {"type": "integer"},
                                           "country": {"enum": ["France", "Italy", "Spain", "Germany"]}},
          "required": ["city", "population", "country"], "additionalProperties": False}
QUESTION = "List European cities with their population and country, as JSON."


def schema(extra: str = "") -> dict:
    """A list of records that cannot close early (minItems), with an optional extra property name
    (a distinct schema, so its grammar compiles cold)."""
    properties = {"cities": {"type": "array", "items": RECORD, "minItems": 40}}
    if extra:
        properties[extra] = {"type": "string"}
    return {"type": "object", "properties": properties, "required": ["cities"]}


def decode_tpot(engine: Engine, prompt: list[int], batch: int, tokens: int, spec: StructuredOutput | None) -> float:
    """Median seconds of the decode steps of a batch of `batch` requests."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=spec is None, structured=spec)
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, params)
    steps = []
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        if engine.last_step_tokens.prefill == 0:
            steps.append(time.perf_counter() - started)
    return statistics.median(steps)


def ttft(engine: Engine, prompt: list[int], spec: StructuredOutput | None) -> float:
    """Seconds from adding one request (after compiling its grammar, as a worker's handler does) to
    its first token."""
    started = time.perf_counter()
    if spec is not None:
        engine.grammars.compile(spec)
    engine.add_request("ttft", prompt, SamplingParams(max_tokens=1, temperature=0.0, structured=spec))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def main(argv: Sequence[str]) -> int:
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig())
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    constrained = StructuredOutput("json", json.dumps(schema()))
    engine.grammars.compile(constrained)
    results: dict = {"command": command_line(__name__, argv), "machine": describe(), "load": load_average(),
                     "formats": engine.formats.describe(), "threads": args.threads, "tokens": args.tokens,
                     "decode": {}, "ttft": {}}
    ttft(engine, prompt, None)  # warm-up
    for batch in (int(b) for b in args.batches.split(",")):
        free, bound = [], []
        for _ in range(args.repeats):
            free.append(decode_tpot(engine, prompt, batch, args.tokens, None))
            bound.append(decode_tpot(engine, prompt, batch, args.tokens, constrained))
        row = {"free_ms": 1e3 * statistics.median(free), "constrained_ms": 1e3 * statistics.median(bound)}
        row["ratio"] = row["constrained_ms"] / row["free_ms"]
        results["decode"][batch] = row
        print(f"[structured] batch {batch}: TPOT free {row['free_ms']:.1f} ms, constrained "
              f"{row['constrained_ms']:.1f} ms, {row['ratio']:.3f}x", flush=True)
    timings: dict[str, list[float]] = {"free": [], "cached": [], "cold": []}
    for repeat in range(args.repeats):
        timings["free"].append(ttft(engine, prompt, None))
        timings["cached"].append(ttft(engine, prompt, constrained))
        timings["cold"].append(ttft(engine, prompt, StructuredOutput("json", json.dumps(schema(f"note{repeat}")))))
    results["ttft"] = {name: 1e3 * statistics.median(values) for name, values in timings.items()}
    print(f"[structured] TTFT free {results['ttft']['free']:.1f} ms, cached grammar {results['ttft']['cached']:.1f}"
          f" ms, cold grammar {results['ttft']['cold']:.1f} ms", flush=True)
    print(f"\n{describe()['processor']}, {args.threads} thread(s); {results['formats']}\n")
    print("| batch | TPOT free | TPOT JSON schema | ratio |\n|---:|---:|---:|---:|")
    for batch, row in results["decode"].items():
        print(f"| {batch} | {row['free_ms']:.1f} ms | {row['constrained_ms']:.1f} ms | {row['ratio']:.3f}x |")
    write_results(args.out, results)
    return 0
