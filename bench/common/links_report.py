"""The links suite's tables (bench.suites.links): TTFT and the transfer per link against the
in-process engine, the KV settings against the baseline's on the same link, and the checksum's
share of each transfer."""

from __future__ import annotations

import argparse

from bench.common import kv_rig
from bench.common.kv_setting import BASELINE, ratio

HIDDEN_TARGET = 0.80
CHECKSUM_LIMIT = 0.03
COMPARED = ("kv_bytes_per_token", "transfer_alone_s", "ttft_s")


def checksum_share(on_s: float, off_s: float) -> float:
    """The checksum's share of a transfer with it on, from the same transfer with it off."""
    return max(0.0, 1.0 - off_s / on_s)


def setting_rows(by_setting: dict[str, dict[str, dict]]) -> list[dict]:
    """One row per setting, link and prompt size: its figures and their ratios against the first
    setting's on the same link and size (None where either is missing)."""
    baseline = next(iter(by_setting.values()))
    rows = []
    for label, links in by_setting.items():
        for link, figures in links.items():
            for size, row in figures["requests"].items():
                base = baseline[link]["requests"][size]
                rows.append({"kv": label, "link": link, "prompt": size, **row, "vs": {
                    key: ratio(row[key], base[key]) for key in COMPARED}})
    return rows


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def _times(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def print_table(args: argparse.Namespace, in_process: dict[int, float], loopback: dict,
                hosts: dict[str, dict[str, dict]], loads: dict) -> None:
    print(f"\n{args.requests} requests one after another per prompt size, {args.output_tokens} output tokens, "
          f"greedy, torch_dist (gloo) KV with CRC32C; medians. No latency injected (no netem): bandwidth caps only.")
    print(f"load average: {loads['start']} (start), {loads['end']} (end)\n")
    print(f"KV in {BASELINE.label}:\n")
    print("| link | prompt | TTFT (ms) | vs in-process | delivery wait (ms) | transfer alone (ms) | hidden |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for size, ttft in in_process.items():
        print(f"| in-process | {size} | {ttft * 1e3:.1f} | 1.00x | | | |")
    for name, link in {"loopback": loopback, **hosts[BASELINE.label]}.items():
        for size, row in link["requests"].items():
            hidden = "" if row["hidden"] is None else f"{row['hidden']:.0%}"
            print(f"| {name} | {size} | {row['ttft_s'] * 1e3:.1f} | {row['ttft_s'] / in_process[size]:.2f}x | "
                  f"{_ms(row['delivery_wait_s'])} | {row['transfer_alone_s'] * 1e3:.1f} | {hidden} |")
    print(f"\nhidden = 1 - delivery wait / transfer alone on the same link (target >= {HIDDEN_TARGET:.0%} at 1gbit)")
    print(f"\nPer KV setting on the hosts, ratios against {BASELINE.label} on the same link and prompt size:\n")
    print("| KV | link | prompt | bytes/token | vs | wire floor (ms) | transfer alone (ms) | vs | delivery wait (ms) "
          "| TTFT p50 (ms) | vs |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in setting_rows(hosts):
        vs = row["vs"]
        print(f"| {row['kv']} | {row['link']} | {row['prompt']} | {row['kv_bytes_per_token']:,.0f} | "
              f"{_times(vs['kv_bytes_per_token'])} | {_ms(row['wire_s'])} | {_ms(row['transfer_alone_s'])} | "
              f"{_times(vs['transfer_alone_s'])} | {_ms(row['delivery_wait_s'])} | {_ms(row['ttft_s'])} | "
              f"{_times(vs['ttft_s'])} |")
    print("\nbytes/token: shipped by the prefill worker's senders per prompt token; wire floor: those bytes at "
          "the link's rate")
    print(f"\nThe checksum on the same link, the rig's {kv_rig.PROMPT_TOKENS}-token prompt "
          f"({kv_rig.TOTAL_BYTES / 1e6:.1f} MB in {BASELINE.label}), --kv-checksum on and off at both ends:\n")
    print("| KV | link | backend | on (ms) | off (ms) | checksum share |")
    print("|---|---|---|---:|---:|---:|")
    runs = [(BASELINE.label, "loopback", loopback)]
    runs += [(label, name, link) for label, links in hosts.items() for name, link in links.items()]
    for label, name, link in runs:
        for backend, figures in link["transfers"].items():
            print(f"| {label} | {name} | {backend} | {figures['on'] * 1e3:.1f} | {figures['off'] * 1e3:.1f} | "
                  f"{checksum_share(figures['on'], figures['off']):.1%} |")
    print(f"\nchecksum share = 1 - off / on (stays on by default below {CHECKSUM_LIMIT:.0%})")
