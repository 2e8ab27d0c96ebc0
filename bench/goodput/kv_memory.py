"""What a configuration's KV memory holds, read from its servers' own start-up lines: Tandem's
engines ("engine ready: ..., N KV blocks of B tokens, kv_cache=FORMAT") and vLLM's ("KV cache size:
N tokens"). Equal bytes hold equal tokens only in equal formats, so the suite reports what each
server says it holds rather than what the bytes should give."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

_TANDEM = re.compile(r"engine ready: .*?(\d+) KV blocks of (\d+) tokens.*?kv_cache=(\w+)")
_VLLM = re.compile(r"KV cache size: ([\d,]+) tokens")


def kv_held(lines: Sequence[str]) -> dict:
    """The KV tokens every engine in `lines` (its servers' logs) holds, in all, and each one's
    format ("vllm" where vLLM's line does not name it); {} when no line says."""
    engines = []
    for line in lines:
        if match := _TANDEM.search(line):
            engines.append({"tokens": int(match[1]) * int(match[2]), "format": match[3]})
        elif match := _VLLM.search(line):
            engines.append({"tokens": int(match[1].replace(",", "")), "format": "vllm"})
    if not engines:
        return {}
    return {"tokens": sum(e["tokens"] for e in engines), "engines": engines}


def read_logs(paths: Sequence[str]) -> list[str]:
    """Every line of the logs that exist."""
    lines: list[str] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as file:
                lines += file.read().splitlines()
        except FileNotFoundError:
            continue
    return lines


def report_kv_memory(name: str, log_paths: Sequence[str], working_set_tokens: int | None) -> dict:
    """The KV tokens configuration `name`'s servers (their logs) say they hold, and the working set
    as a multiple of them, printed and returned."""
    held = kv_held(read_logs(log_paths))
    if not held:
        return held
    if working_set_tokens:
        held["working_set_ratio"] = working_set_tokens / held["tokens"]
    print(f"[goodput] {name} holds {held['tokens']} KV tokens ("
          + ", ".join(f"{e['tokens']} {e['format']}" for e in held["engines"]) + ")"
          + (f": the working set is {held['working_set_ratio']:.1f}x that" if working_set_tokens else ""),
          file=sys.stderr, flush=True)
    return held
