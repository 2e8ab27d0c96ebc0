"""OpenAI's `prediction` on an editing workload at batch 1: decode tok/s with the edited text sent as
the prediction against without, through the mesh (target >= 1.5x).

The workload: each of the input-grounded passages (bench/texts/input-grounded-prompts.json) with
an edit to make ("replace X with Y, changing nothing else"), the passage itself as the prediction,
as a client editing a document sends it. Three systems, alternated per request, through
bench/common/speculative_mesh.py's gateways (one prefill worker; a decode worker without and one
with `--speculative-config`): `default` (no speculation), `ngram` (drafts from the request's own
tokens, prompt included) and `ngram+prediction` (drafts from the prediction first). Each is a
streamed chat request, greedy; decode tok/s is the completion's tokens after the first over the
time after the first, summed over requests. Outputs must be equal on all three (the prediction
changes speed, never the tokens); the suite fails otherwise.

    python -m bench prediction [--config JSON] [--repeats 2] [--max-tokens 160]
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import openai

from bench.common.machine import describe
from bench.common.speculative_mesh import SpeculativeMesh
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results

PROMPTS = Path(__file__).resolve().parents[1] / "texts" / "input-grounded-prompts.json"
EDITS = [("hacker", "programmer"), ("the", "a"), ("and", "or"), ("is", "was")]
SYSTEMS = ("default", "ngram", "ngram+prediction")
DEFAULT_CONFIG = json.dumps({"method": "ngram"})


def editing_workload() -> list[tuple[str, str]]:
    """(request text, prediction) per passage: the edit asked for and the text as it stands."""
    passages = [p["passage"] for p in json.loads(PROMPTS.read_text(encoding="utf-8"))["prompts"]]
    return [(f"Edit the following passage: replace every \"{old}\" with \"{new}\", changing nothing else. "
             f"Answer with the edited passage only.\n\n{passage}", passage)
            for passage, (old, new) in zip(passages, EDITS * len(passages), strict=False)]


def one_request(client: openai.OpenAI, text: str, prediction: str | None, max_tokens: int) -> dict:
    """A streamed chat request; its text, tokens and decode seconds (first to last token). The
    model is the gateway's (one served model)."""
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction is not None else {}
    first = last = None
    pieces, tokens = [], 0
    stream = client.chat.completions.create(model="", stream=True, temperature=0.0,
                                            messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                                            stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
            pieces.append(chunk.choices[0].delta.content)
    assert first is not None and last is not None
    return {"text": "".join(pieces), "tokens": tokens, "decode_s": last - first}


def main(argv: Sequence[str]) -> int:
    """The three systems per request, alternately; the table and the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="--speculative-config of the speculating worker")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", default=str(results_path(__name__)))
    args = parser.parse_args(argv)
    workload = editing_workload()
    mesh = SpeculativeMesh(args.config)
    clients = {system: openai.OpenAI(base_url=f"http://{mesh.http_addresses[system]}/v1", api_key="unused",
                                     max_retries=0, timeout=600) for system in ("default", "ngram")}
    runs: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
    drafted = {system: [0.0, 0.0] for system in SYSTEMS}
    try:
        one_request(clients["ngram"], *workload[0], args.max_tokens)  # warm-up
        one_request(clients["default"], workload[0][0], None, args.max_tokens)
        for repeat in range(args.repeats):
            for index, (text, predicted) in enumerate(workload):
                for system in SYSTEMS:
                    before = mesh.counters()
                    client = clients["default" if system == "default" else "ngram"]
                    result = one_request(client, text, predicted if system == "ngram+prediction" else None,
                                         args.max_tokens)
                    after = mesh.counters()
                    drafted[system][0] += after[0] - before[0]
                    drafted[system][1] += after[1] - before[1]
                    runs[system].append({"repeat": repeat, "request": index, **result})
                    print(f"[prediction] repeat {repeat + 1} request {index} {system}: {result['tokens']} tokens, "
                          f"{(result['tokens'] - 1) / result['decode_s']:.1f} tok/s", flush=True)
    finally:
        mesh.stop()
    differing = sorted({d["request"] for system in SYSTEMS[1:] for r, d in zip(runs[system], runs["default"],
                                                                               strict=True) if r["text"] != d["text"]})
    machine = describe()
    print(f"\n{machine['processor']} ({', '.join(machine['isa'])}); through the mesh, batch 1, greedy; "
          f"speculative config {args.config}; {len(workload)} edits x {args.repeats}\n")
    print("| system | decode tok/s | ratio to default | ratio to ngram | acceptance |")
    print("|---|---:|---:|---:|---:|")
    rates = {system: _rate(runs[system]) for system in SYSTEMS}
    for system in SYSTEMS:
        drafts, accepted = drafted[system]
        acceptance = f"{accepted / drafts:.0%} of {drafts:.0f}" if drafts else "no drafts"
        print(f"| {system} | {rates[system]:.1f} | {rates[system] / rates['default']:.2f}x | "
              f"{rates[system] / rates['ngram']:.2f}x | {acceptance} |")
    print(f"\noutputs equal on all three: {'yes' if not differing else f'NO, requests {differing}'}")
    write_results(args.out, {"command": command_line(__name__, argv), "machine": machine, "load": load_average(),
                             "config": args.config, "max_tokens": args.max_tokens, "rates": rates,
                             "drafted": drafted, "differing": differing,
                             "runs": {s: [{k: v for k, v in r.items() if k != "text"} for r in rs]
                                      for s, rs in runs.items()}})
    return 1 if differing else 0


def _rate(runs: list[dict]) -> float:
    """Decode tok/s over the runs: tokens after each first over the time after it, summed."""
    return sum(r["tokens"] - 1 for r in runs) / sum(r["decode_s"] for r in runs)

