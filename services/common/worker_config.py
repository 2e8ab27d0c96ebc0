"""What one worker process serves and how: its `serve(config)` argument, built from its flags."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from kvtransfer.descriptor import Backend
from services.common.channels import Channels
from services.repository.config import ModelVersion
from services.repository.swap_settings import SwapSettings


@dataclass(frozen=True)
class WorkerConfig:
    """A prefill, decode or colocated worker (`engine.role`).

    `engine` is what the flags describe; with a model repository, `version` (the one named or the
    pool's) is applied to it (`served_engine`), as each version a hot swap (`swap`) loads is.
    """

    engine: EngineConfig
    host: str
    port: int  # 0: a free port
    advertise_host: str  # the address peers reach it at: its ready line, its KV receiver and pairs
    grace_period: float  # seconds in-flight requests get to finish on SIGTERM
    metrics_port: int  # 0: a free port
    channels: Channels
    kv_backend: Backend = "torch_dist"  # how prompts' KV pages arrive (decode and colocated)
    kv_host: str = ""  # where the torch_dist rendezvous stores bind ("": advertise_host)
    kv_timeout: float = 30.0  # seconds a prompt's KV may take between the workers
    kv_checksum: bool = True  # False: no CRC32C with peers that are off too
    version: ModelVersion | None = None
    swap: SwapSettings | None = None

    @property
    def served_engine(self) -> EngineConfig:
        """The engine config the worker starts with."""
        return self.engine if self.version is None else self.version.serving(self.engine)
