"""How a worker follows its pool's version in the model repository (services.decode.model_swap)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapSettings:
    """Where a worker's version comes from, and what a swap may hold."""

    repository: str  # the repository file (--model-repository)
    pool: str  # the pool whose version this worker serves (--pool)
    memory_limit_bytes: int | None = None  # both versions together (--memory-limit-mib); None: no swap
    interval_s: float = 1.0  # how often the file is polled
    retire_after_s: float = 5.0  # how long a version must get no traffic before it is unloaded

    def __post_init__(self) -> None:
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit: must be positive, got {self.memory_limit_bytes} bytes")
        if self.interval_s <= 0 or self.retire_after_s < 0:
            raise ValueError("interval_s must be positive and retire_after_s not negative")
