"""What /v1/models and ListModels list: every model version served, with its state and formats, and
every LoRA adapter routed to, as vLLM lists one (its base as `parent`, its directory as `root`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.gateway.adapters import AdapterTable
from services.gateway.catalog import ModelCatalog, UnknownModel
from services.gateway.formats import served_formats
from services.gateway.workers import RemoteWorker


@dataclass(frozen=True)
class ModelListing:
    """One served model version, or one LoRA adapter, as /v1/models and ListModels show it."""

    id: str
    version: str  # "" for a gateway of one model, and for an adapter
    max_model_len: int
    state: str  # "serving", "loading" or "draining"
    formats: dict[str, str | None]  # services.gateway.formats
    parent: str | None = None  # an adapter's base: its version (NAME@VERSION), or the one model's name
    root: str | None = None  # an adapter's directory, as its workers read it


def model_listings(catalog: ModelCatalog, workers: Iterable[RemoteWorker],
                   adapters: AdapterTable) -> list[ModelListing]:
    """The catalog's versions, then the adapters its workers serve over them."""
    workers = list(workers)
    listings = []
    for entry in catalog.entries:
        key = entry.version.version_key if entry.version is not None else None
        holding = [worker for worker in workers if worker.report is not None and worker.offers(key)]
        # A version only retiring workers hold (a hot swap in their processes) is on its way out.
        state = ("serving" if any(worker.routable and key in (None, worker.version_key) for worker in holding)
                 else "draining" if holding else "loading")
        listings.append(ModelListing(entry.model.id, entry.version.name if entry.version is not None else "",
                                     entry.model.max_model_len, state,
                                     served_formats(worker.report for worker in holding)))
    for adapter in adapters.served.values():
        try:
            target = catalog.adapter_target(adapter)
        except UnknownModel:
            continue  # over a base version this gateway does not serve: no request reaches it
        holding = [worker for worker in workers if worker.address in adapter.workers]
        listings.append(ModelListing(adapter.name, "", target.model.max_model_len, "serving",
                                     served_formats(worker.report for worker in holding),
                                     target.version_key or target.model.id, adapter.path))
    return listings
