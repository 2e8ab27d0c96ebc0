"""The LoRA adapters the gateway routes to, kept current from its workers' load reports.

Rebuilt whenever a worker's report or health changes (services.gateway.registry's listeners), so a
request looks the table up rather than walking every worker's report. A conflict (an adapter name
the workers serve with two fingerprints or over two base versions, or one a model already takes:
services.gateway.adapters) is refused loudly: logged when it appears and when it clears, exported as
`tandem:lora_adapter_conflict{adapter}` (1 while it lasts), and shown in /health.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.gateway.adapters import AdapterTable, WorkerAdapters
from services.gateway.registry import WorkerRegistry

log = logging.getLogger(__name__)


class AdapterWatch(Collector):
    """The adapter table over `registry`'s routable workers; `models()` gives the names models
    take (an adapter cannot)."""

    def __init__(self, registry: WorkerRegistry, models: Callable[[], Collection[str]]) -> None:
        self._registry = registry
        self._models = models
        self.table = AdapterTable({}, {})
        registry.on_change(self.refresh)

    def refresh(self) -> None:
        """Rebuild the table from the workers' latest reports."""
        workers = [WorkerAdapters(w.address, w.version_key, w.adapters) for w in self._registry.workers if w.routable]
        table = AdapterTable.of(workers, self._models())
        for name, reason in table.conflicts.items():
            if self.table.conflicts.get(name) != reason:
                log.error("LoRA adapter %s is not routed: %s", name, reason)
        for name in self.table.conflicts.keys() - table.conflicts.keys():
            log.info("LoRA adapter %s: its workers agree again", name)
        self.table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tandem:lora_adapter_conflict",
                                   "1 for each LoRA adapter name not routed because its workers serve it with "
                                   "different weights or over different base versions, or a model has its name.",
                                   labels=["adapter"])
        for name in self.table.conflicts:
            family.add_metric([name], 1)
        yield family
