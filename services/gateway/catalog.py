"""The models a gateway serves, and which one a request's `model` names.

Either one model (`--model`: any worker serves it, as before model repositories) or a model
repository's every version (`--model-repository`), each with its own tokenizer, chat template and
context length. A request names `NAME` (the repository's split picks the version, sticky per
caller: services.repository.split), `NAME@VERSION` (exactly that one), or nothing (the first model).
A LoRA adapter a worker serves is named by its own name, which no model shares
(services.gateway.adapters): it runs on its base version, with the base's tokenizer and limits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.gateway.adapters import AdapterRef, ServedAdapter
from services.gateway.model import ServedModel
from services.repository.config import ModelRepository, ModelVersion, RepositoryModel
from services.repository.split import choose_version


class UnknownModel(LookupError):
    """A request named a model or version this gateway does not serve (NOT_FOUND / 404)."""


@dataclass(frozen=True)
class Target:
    """What a request runs on: the version's tokenizer and limits, the name to answer with, and the
    workers that may serve it."""

    model: ServedModel
    answered_as: str  # the `model` the reply carries: what the client asked for, or the model's name
    version: str  # the repository's version ("" for a gateway of one model)
    version_key: str | None  # NAME@VERSION its workers report; None: any worker
    adapter: AdapterRef | None = None  # the LoRA adapter it runs under; None: the base model

    @property
    def fingerprint(self) -> str:
        """What names the served version to the client (system_fingerprint, a header, a trailer):
        the base version, and the adapter after a `+`."""
        base = f"{self.model.id}@{self.version}" if self.version else self.model.id
        return f"{base}+{self.adapter.name}" if self.adapter is not None else base

    @property
    def served_name(self) -> str:
        """The model its requests are counted under (the metrics' model_name): the adapter's name,
        so that usage shows per adapter, else the model's."""
        return self.adapter.name if self.adapter is not None else self.model.id


@dataclass(frozen=True)
class CatalogEntry:
    """One version as /v1/models and ListModels list it."""

    model: ServedModel
    version: ModelVersion | None  # None for a gateway of one model

    @property
    def key(self) -> str:
        return self.version.version_key if self.version is not None else self.model.id


class ModelCatalog:
    """Every version the gateway serves, loaded (tokenizers read) at start-up."""

    def __init__(self, entries: list[CatalogEntry], repository: ModelRepository | None = None) -> None:
        self.entries = entries
        self.repository = repository
        self._by_key = {entry.key: entry for entry in entries}

    @classmethod
    def single(cls, model: ServedModel) -> ModelCatalog:
        """A gateway of one model, served by whichever workers it routes to."""
        return cls([CatalogEntry(model, None)])

    @classmethod
    def load(cls, repository: ModelRepository, max_model_len: int | None = None,
             previous: ModelCatalog | None = None) -> ModelCatalog:
        """Every version of the repository (tokenizer and context length read from its file, or
        taken from `previous` for a version it holds unchanged)."""
        kept = {entry.version: entry for entry in previous.entries} if previous is not None else {}
        entries = []
        for version in repository.versions:
            if version in kept:
                entries.append(kept[version])
                continue
            served = ServedModel.load(version.weights, version.max_model_len or max_model_len)
            entries.append(CatalogEntry(ServedModel(version.model, served.max_model_len, served.tokenizer), version))
        return cls(entries, repository)

    def with_split(self, name: str, split: dict[str, int]) -> ModelCatalog:
        """This catalog with model `name`'s split replaced; UnknownModel for a model it lacks,
        ValueError (naming the field) for a split the repository refuses."""
        model = self.repository.model(name) if self.repository is not None else None
        if self.repository is None or model is None:
            raise UnknownModel(f"The model `{name}` has no split here; a split needs --model-repository "
                               "and one of its models.")
        changed = dataclasses.replace(model, split=tuple(split.items()))
        models = tuple(changed if m.name == name else m for m in self.repository.models)
        return ModelCatalog(self.entries, dataclasses.replace(self.repository, models=models))

    def describe(self) -> str:
        """One line: each version and its share of its name's traffic."""
        if self.repository is None:
            return self.default_name
        return "; ".join(
            f"{model.name}: " + ", ".join(f"{version.name} {weight}%" for version, weight in model.weights)
            + (f" (also {', '.join(v.name for v in model.versions if v not in dict(model.weights))})"
               if len(model.weights) < len(model.versions) else "")
            for model in self.repository.models)

    def model_for(self, version_key: str | None) -> ServedModel | None:
        """The model a worker reporting `version_key` (NAME@VERSION) serves, as this gateway loaded
        it: the one model of a gateway without a repository; None for a version not served."""
        if self.repository is None:
            return self.entries[0].model
        entry = self._by_key.get(version_key or "")
        return entry.model if entry is not None else None

    @property
    def names(self) -> frozenset[str]:
        """Every name a request's `model` may give for a model (an adapter may take none of them)."""
        if self.repository is None:
            return frozenset({self.default_name})
        return frozenset({model.name for model in self.repository.models}
                         | {version.version_key for version in self.repository.versions})

    @property
    def declared_adapters(self) -> dict[str, str]:
        """The LoRA adapters the repository declares (services.gateway.adapter_sync loads them), by
        name, with their base version's NAME@VERSION."""
        if self.repository is None:
            return {}
        return {adapter.name: base for base, adapter in self.repository.adapters}

    def adapter_target(self, adapter: ServedAdapter) -> Target:
        """The target of a request naming `adapter`: its base version's; UnknownModel when this
        gateway does not serve that base version."""
        if self.repository is None:
            return Target(self.entries[0].model, adapter.name, "", None, adapter.ref)
        entry = self._by_key.get(adapter.base or "")
        if entry is None or entry.version is None:
            raise UnknownModel(f"The model `{adapter.name}` is an adapter over {adapter.base}, which this server "
                               "does not serve.")
        return Target(entry.model, adapter.name, entry.version.name, entry.key, adapter.ref)

    @property
    def default_name(self) -> str:
        """The model a request that names none gets."""
        return self.entries[0].model.id

    def resolve(self, requested: str, caller: str | None = None) -> Target:
        """The version `requested` names for this caller (`caller`: the OpenAI `user`, else the API
        key's name; None draws per request); UnknownModel naming what is not served."""
        name, at, version_name = (requested or self.default_name).partition("@")
        answered_as = requested or self.default_name
        if self.repository is None:
            model = self.entries[0].model
            if name != model.id or at:
                raise UnknownModel(f"The model `{requested}` does not exist; this server serves `{model.id}`.")
            return Target(model, answered_as, "", None)
        repository_model = self.repository.model(name)
        if repository_model is None:
            raise UnknownModel(f"The model `{requested}` does not exist; this server serves "
                               f"{', '.join(f'`{m.name}`' for m in self.repository.models)}.")
        version = self._version(repository_model, version_name, at, caller)
        return Target(self._by_key[version.version_key].model, answered_as, version.name, version.version_key)

    def _version(self, model: RepositoryModel, version_name: str, at: str, caller: str | None) -> ModelVersion:
        if not at:
            return choose_version(model, caller)
        version = model.version(version_name)
        if version is None:
            raise UnknownModel(f"The model `{model.name}` has no version `{version_name}` (versions: "
                               f"{', '.join(v.name for v in model.versions)}).")
        return version
