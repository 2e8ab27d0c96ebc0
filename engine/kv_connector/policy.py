"""How an engine's KV connector behaves, decided once from the engine's configuration: the one place
where the deployment (prefill, decode or colocated: `EngineConfig.role`) shapes the engine. Whether
a request hands its prompt's KV on is the request's own (it was added with a KVExport, on any
engine); what stays per engine is whether it decodes at all."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig

# Backstops for a peer that never answers. The workers end such requests first, by their own
# `--kv-timeout`; these only bound what the engine holds if a worker never does.
DEFAULT_KV_WAIT_S = 30.0
KEEP_HANDED_OFF_S = 120.0


@dataclass(frozen=True)
class KVConnectorPolicy:
    """`decodes`: False for a prefill-only engine, where every request hands off (as an exported one
    does anywhere): it ends once its prompt is computed and its first token sampled
    (FinishReason.HANDOFF, or STOP/LENGTH on that token) and keeps its blocks until released, at
    most `keep_s` seconds, while its KV goes on to a decode site. Any engine accepts reservations
    for KV computed elsewhere."""

    decodes: bool = True
    keep_s: float = KEEP_HANDED_OFF_S

    @classmethod
    def of(cls, config: EngineConfig) -> KVConnectorPolicy:
        """The policy of an engine deployed as `config.role`."""
        return cls(decodes=config.role != "prefill")

    def describe(self) -> str:
        """One line for the engine's start-up log."""
        kept = f"their blocks kept up to {self.keep_s:g} s"
        if not self.decodes:
            return f"every prompt handed off, {kept}"
        return f"requests decoded here unless exported ({kept})"
