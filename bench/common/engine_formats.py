"""What number formats an engine under a benchmark runs in, for its results: recorded beside every
figure, since the defaults resolve differently on each machine."""

from __future__ import annotations

from typing import Any

FORMAT_FIELDS = ("dtype", "quantization", "kv_cache_dtype", "cpu_weights")


def engine_formats(engine: Any) -> dict[str, str]:
    """The engine's own account of its formats where it gives one (`Engine.formats`, resolved at
    start-up from the hardware), and the format fields of its config as asked for."""
    config = engine.config
    asked = {name: str(getattr(config, name)) for name in FORMAT_FIELDS if hasattr(config, name)}
    resolved = getattr(engine, "formats", None)
    return {**asked, **({"resolved": resolved.describe()} if resolved is not None else {})}
