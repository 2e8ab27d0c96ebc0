"""The goodput suite's comparison of KV settings (`--kv-formats`, bench/common/kv_setting.py): every
Tandem configuration runs once per setting, in the same run and with the same requests, named
`CONFIG:SETTING` ("Tandem colocated, one engine on 2 cores, KV int8"); a vLLM configuration runs
once, as it takes no Tandem KV setting. Each Tandem row gets its setting's KV bytes per token,
computed from the setting and the model's header (the engine's arithmetic, not read from a worker),
and its goodput as a ratio to the first setting's for the same configuration and run.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.common.kv_setting import KVSetting, ratio
from bench.common.metrics import Slo
from bench.goodput.deploy import VLLM_DTYPES
from bench.goodput.report import label, slo_text


def expand(configs: Sequence[str], settings: Sequence[KVSetting] | None) -> list[tuple[str, KVSetting | None]]:
    """(name, setting) per measurement of `configs`: each Tandem one once per setting (none without
    settings), each vLLM one once."""
    measurements: list[tuple[str, KVSetting | None]] = []
    for config in configs:
        if settings and config not in VLLM_DTYPES:
            measurements += [(setting_name(config, setting), setting) for setting in settings]
        else:
            measurements.append((config, None))
    return measurements


def setting_name(config: str, setting: KVSetting) -> str:
    """A configuration's name under a KV setting."""
    return f"{config}:{setting.label}"


def kv_entry(config: str, setting: KVSetting, baseline: KVSetting, bytes_per_token: float, repeat: str) -> dict:
    """What the results hold of a measurement's KV setting: its label, KV bytes per token and the
    name of the measurement its goodput is compared with (`repeat`: the name's "#N" suffix or "")."""
    return {"setting": setting.label, "bytes_per_token": bytes_per_token,
            "baseline": setting_name(config, baseline) + repeat}


def format_kv(configs: dict[str, dict], slos: Sequence[Slo]) -> str:
    """Per Tandem measurement under a KV setting: its KV bytes per token and goodput at each SLO,
    each beside its ratio to the baseline setting's for the same configuration and run ("-" where
    the baseline was skipped)."""
    header = ["configuration", "KV bytes per token", "x baseline", *(f"goodput, {slo_text(s)} (req/s)" for s in slos),
              *("x baseline" for _ in slos)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, data in configs.items():
        if "kv" not in data or "goodput" not in data:
            continue
        kv = data["kv"]
        base = configs.get(kv["baseline"], {})
        base_bytes = base.get("kv", {}).get("bytes_per_token")
        goodputs = [data["goodput"][s.name]["interpolated"] for s in slos]
        base_goodputs = [base["goodput"][s.name]["interpolated"] if "goodput" in base else None for s in slos]
        cells = [f"{kv['bytes_per_token']:,.0f}", _times(ratio(kv["bytes_per_token"], base_bytes)),
                 *(f"{g:.2f}" for g in goodputs),
                 *(_times(ratio(g, b)) for g, b in zip(goodputs, base_goodputs, strict=True))]
        lines.append(f"| {label(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
