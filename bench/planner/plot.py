"""The planner simulation's figure: replicas per pool (planner asked, planner ready, oracle) and SLO
attainment over the simulated day."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_day(trace, summary: dict, path: str) -> None:
    """Three panels sharing the time axis (hours): prefill replicas, decode replicas, attainment."""
    hours = [minute / 60 for minute in range(len(trace.rate))]
    figure, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True, height_ratios=[2, 2, 1.3])
    for axis, role in zip(axes, ("prefill", "decode"), strict=False):
        axis.step(hours, trace.oracle[role], where="post", color="tab:gray", label="oracle")
        axis.step(hours, trace.requested[role], where="post", color="tab:blue", label="planner (asked)")
        axis.step(hours, trace.ready[role], where="post", color="tab:blue", alpha=0.4, linestyle="--",
                  label="planner (ready)")
        axis.set_ylabel(f"{role} replicas")
        axis.legend(loc="upper left", fontsize=8)
        axis.grid(alpha=0.3)
        rate = axis.twinx()
        rate.plot(hours, trace.rate, color="tab:orange", alpha=0.35, linewidth=0.8)
        rate.set_ylabel("requests/s", color="tab:orange")
    attainment = axes[2]
    attainment.plot(hours, trace.met_share, color="tab:green", linewidth=0.8, label="requests meeting the SLO")
    missed = [h for h, ok in zip(hours, trace.attained, strict=True) if not ok]
    attainment.scatter(missed, [0.0] * len(missed), color="tab:red", marker="|", label="minute not attained")
    attainment.axhline(0.9, color="tab:red", linestyle=":", linewidth=0.8)
    attainment.set_ylim(-0.05, 1.05)
    attainment.set_ylabel("share per minute")
    attainment.set_xlabel("simulated hour")
    attainment.legend(loc="lower left", fontsize=8)
    attainment.grid(alpha=0.3)
    figure.suptitle(f"Planner vs oracle: {summary['replica_hours_ratio']:.2f}x replica-hours, "
                    f"SLO attained in {summary['attainment']:.1%} of minutes")
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
