"""The fidelity suite's verdicts and its markdown table."""

from __future__ import annotations

from bench.fidelity.formats import REFERENCE, Format


def verdict(fmt: Format, results: dict[str, dict]) -> dict:
    """The format's perplexity rise over the row it is held against and whether the bound holds:
    `met`, `MISSED`, `reported` (no bound) or `-` (a perplexity is missing)."""
    mine = results.get(fmt.name, {}).get("perplexity")
    theirs = results.get(fmt.against, {}).get("perplexity") if fmt.against else None
    if mine is None or theirs is None:
        return {"rise": None, "verdict": "-"}
    rise = mine / theirs - 1
    if fmt.bound is None:
        return {"rise": rise, "verdict": "reported"}
    return {"rise": rise, "verdict": "met" if rise <= fmt.bound else "MISSED"}


def agreement(forks: list[int], tokens: int) -> str:
    """Greedy agreement as the tables show it: the first differing token of each prompt's `tokens`,
    and how many prompts agree throughout."""
    identical = sum(f == tokens for f in forks)
    return f"{', '.join(map(str, forks))} ({identical} of {len(forks)} identical)"


def _greedy(result: dict) -> str:
    forks = result.get("first_difference")
    return "-" if forks is None else agreement(forks, result["greedy_tokens"])


def format_table(formats: list[Format], results: dict[str, dict], greedy_tokens: int) -> str:
    """One line per format: perplexity, the row it is held against, its rise and bound, the verdict,
    and greedy agreement with fp32 (first differing token per prompt); skipped and failed rows say why."""
    lines = [f"| format | perplexity | against | rise | bound | verdict | greedy vs {REFERENCE}: first difference "
             f"(of {greedy_tokens}) per prompt |", "|---|---:|---|---:|---:|---|---|"]
    for fmt in formats:
        result = results.get(fmt.name, {})
        if "perplexity" not in result:
            reason = result.get("skipped") or result.get("failed") or "not run"
            lines.append(f"| {fmt.name} | - | {fmt.against or '-'} | - | {_bound(fmt)} | "
                         f"{'skipped' if 'skipped' in result else 'FAILED'}: {reason} | - |")
            continue
        judged = verdict(fmt, results)
        rise = "-" if judged["rise"] is None else f"{judged['rise']:+.3%}"
        lines.append(f"| {fmt.name} | {result['perplexity']:.3f} | {fmt.against or '(reference)'} | {rise} | "
                     f"{_bound(fmt)} | {judged['verdict']} | {_greedy(result)} |")
    return "\n".join(lines)


def retrieval_table(formats: list[Format], results: dict[str, dict], lengths: list[int]) -> str:
    """One line per retrieval row: how many of the planted-fact prompts of each length it answered
    with their code; a row without hits says why."""
    lines = ["| format | " + " | ".join(f"found at {length} tokens" for length in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for fmt in (f for f in formats if f.retrieval):
        result = results.get(fmt.name, {})
        found = result.get("hits")
        if found is None:
            reason = result.get("skipped") or result.get("failed") or "not run"
            lines.append(f"| {fmt.name} | " + " | ".join("-" for _ in lengths) + f" | {reason}")
            continue
        lines.append(f"| {fmt.name} | " + " | ".join(
            f"{sum(found[str(length)])} of {len(found[str(length)])}" for length in lengths) + " |")
    return "\n".join(lines)


def _bound(fmt: Format) -> str:
    return "-" if fmt.bound is None else f"+{fmt.bound:.1%}"
