"""The benchmark suites, one module each, run as `python -m bench SUITE [flags]` from the repository root.

A suite module has a docstring (its first sentence is the suite's summary in `python -m bench --help`)
and `main(argv) -> int`, which parses the suite's own flags and returns the exit code.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

SUITES = (
    "engine_throughput", "speed", "decode_overhead", "cores", "fidelity", "weight_formats", "gptq_awq",
    "kv_transfer", "mesh_overhead", "links", "tracing_overhead", "version_routing", "hot_swap",
    "tensor_parallel", "kv_relay", "goodput", "speculative", "planner_sim",
    "cancel_storm", "overload", "soak", "hf_export", "grammar_backends", "structured",
    "structured_vllm", "prediction", "parallel_layouts", "moe", "kv_tiers", "kv_compression", "kv_eviction",
    "prefix_routing", "lora", "lora_fidelity",
)


def summary(name: str) -> str:
    """The first sentence of suite `name`'s docstring, read without importing the suite (suites import
    torch, which takes seconds)."""
    spec = importlib.util.find_spec(f"{__name__}.{name}")
    assert spec is not None and spec.origin is not None, name
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").split(". ", 1)[0].removesuffix(".")


def usage() -> str:
    """`python -m bench --help`: how to run a suite, and every suite with its summary."""
    width = max(map(len, SUITES))
    lines = ["usage: python -m bench SUITE [flags]   (python -m bench SUITE --help: the suite's flags)", "",
             "suites:"]
    lines += [f"  {name:<{width}}  {summary(name)}" for name in SUITES]
    return "\n".join(lines)


def run(argv: Sequence[str]) -> int:
    """Run the suite named by `argv[0]` with the rest of `argv` as its flags; its exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, *flags = argv
    if name not in SUITES:
        print(f"python -m bench: no suite {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return importlib.import_module(f"{__name__}.{name}").main(flags)
