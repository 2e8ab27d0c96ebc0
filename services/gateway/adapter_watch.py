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

import grpc
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.errors import StatusError
from services.gateway.adapters import AdapterTable, WorkerAdapters
from services.gateway.catalog import ModelCatalog, Target, UnknownModel
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

    def target(self, requested: str, catalog: ModelCatalog, unknown: UnknownModel) -> Target:
        """The target of a request naming the adapter `requested` (no model of `catalog` has that
        name: `unknown` says so). StatusError UNAVAILABLE for an adapter in conflict or declared by
        the repository but served by no worker yet; NOT_FOUND for one not served (as `unknown`), or
        over a base version the catalog lacks."""
        if requested in self.table.conflicts:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"model: {self.table.conflicts[requested]}; not "
                              "routed until its workers agree") from unknown
        adapter = self.table.served.get(requested)
        if adapter is None:
            base = catalog.declared_adapters.get(requested)
            if base is not None:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"model: the adapter `{requested}` is not served "
                                  f"by a worker of {base} yet") from unknown
            raise StatusError(grpc.StatusCode.NOT_FOUND, str(unknown)) from unknown
        try:
            return catalog.adapter_target(adapter)
        except UnknownModel as unserved:
            raise StatusError(grpc.StatusCode.NOT_FOUND, str(unserved)) from unserved

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tandem:lora_adapter_conflict",
                                   "1 for each LoRA adapter name not routed because its workers serve it with "
                                   "different weights or over different base versions, or a model has its name.",
                                   labels=["adapter"])
        for name in self.table.conflicts:
            family.add_metric([name], 1)
        yield family
