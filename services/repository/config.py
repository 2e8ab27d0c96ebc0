"""The model repository: every model a deployment serves, its versions, and how a name picks one.

One TOML file (`--model-repository PATH`), read by the gateway (tokenizers, context lengths, the
split of each name between its versions), by each worker (which version it loads) and by
`tandem mesh` (which workers to start):

    [[model]]
    name = "smollm2"
    split = { q4 = 90, fp32 = 10 }       # optional: weights of a name's versions, summing to 100

    [[model.version]]
    name = "q4"
    path = "shipped"                      # a GGUF file or HF directory, relative to this file;
                                          # "shipped" = the model shipped with Tandem
    quantization = "gguf"                 # optional, as the worker flags: dtype, quantization,
    dtype = "auto"                        # kv_cache_dtype, max_model_len
    pool = "smollm2-q4"                   # optional: the workers started with --pool smollm2-q4
                                          # load it (default: NAME-VERSION)

    [[model.version.adapter]]             # optional: LoRA adapters served over this version, each
    name = "sql"                          # by its own name (a request's `model`; no model or
    path = "adapters/sql"                 # NAME@VERSION may have it); a PEFT directory relative to
                                          # this file, as the workers read it

A name without a split routes to its first version. Every mistake is refused at start-up, naming
the entry and the field. Torch-free: the gateway reads it.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from typing import Any, get_args

from engine.config import DTypeOption, EngineConfig, KVCacheDType, Quantization
from engine.model.paths import default_model_path

SHIPPED = "shipped"
_VERSION_FIELDS = frozenset({"name", "path", "dtype", "quantization", "kv_cache_dtype", "max_model_len", "pool",
                             "adapter"})
_ADAPTER_FIELDS = frozenset({"name", "path"})
_MODEL_FIELDS = frozenset({"name", "split", "version"})
_NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _check_name(entry: str, value: object) -> str:
    if not isinstance(value, str) or not value or not set(value) <= _NAME_CHARACTERS:
        raise ValueError(f"{entry}: name: must be a non-empty string of letters, digits, '-', '_' or '.', "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class RepositoryAdapter:
    """A LoRA adapter the gateway has every worker of its base version serve (services.gateway.adapter_sync)."""

    name: str
    path: str  # absolute: the PEFT directory (adapter_config.json, adapter_model.safetensors)


@dataclass(frozen=True)
class ModelVersion:
    """One version of a model: its weights and the formats its workers serve them in."""

    model: str
    name: str
    path: str  # absolute, or SHIPPED
    dtype: DTypeOption = "auto"
    quantization: Quantization = "auto"
    kv_cache_dtype: KVCacheDType = "auto"
    max_model_len: int | None = None
    pool: str = ""  # "" = NAME-VERSION
    adapters: tuple[RepositoryAdapter, ...] = ()

    def __post_init__(self) -> None:
        entry = f"model {self.model!r} version {self.name!r}"
        _check_name(entry, self.name)
        for name, allowed in (("dtype", DTypeOption), ("quantization", Quantization),
                              ("kv_cache_dtype", KVCacheDType)):
            if getattr(self, name) not in get_args(allowed):
                raise ValueError(f"{entry}: {name}: {getattr(self, name)!r} is not one of "
                                 f"{', '.join(get_args(allowed))}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ValueError(f"{entry}: max_model_len: must be a positive integer, got {self.max_model_len!r}")
        if self.path != SHIPPED and not os.path.exists(self.path):
            raise ValueError(f"{entry}: path: {self.path} does not exist")
        if not self.pool:
            object.__setattr__(self, "pool", f"{self.model}-{self.name}")

    @property
    def version_key(self) -> str:
        """`NAME@VERSION`: how clients, workers and load reports name it."""
        return f"{self.model}@{self.name}"

    @property
    def weights(self) -> str:
        """The weight file or directory the workers load."""
        return default_model_path() if self.path == SHIPPED else self.path

    def serving(self, config: EngineConfig) -> EngineConfig:
        """`config` (a worker's flags) serving this version: its weights and formats, and its context
        length when it sets one, replace the flags'."""
        return dataclasses.replace(
            config, model=self.weights, served_model_name=self.model, model_version=self.name, dtype=self.dtype,
            quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=self.max_model_len or config.max_model_len)


@dataclass(frozen=True)
class RepositoryModel:
    """A model name and its versions; `split` weighs them (percent) for requests naming only the name."""

    name: str
    versions: tuple[ModelVersion, ...]
    split: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        entry = f"model {self.name!r}"
        _check_name(entry, self.name)
        if not self.versions:
            raise ValueError(f"{entry}: version: at least one version is required")
        names = [version.name for version in self.versions]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"{entry}: version: {', '.join(duplicates)} listed more than once")
        for version, weight in self.split:
            if version not in names:
                raise ValueError(f"{entry}: split: no version {version!r} (versions: {', '.join(names)})")
            if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
                raise ValueError(f"{entry}: split: {version}: the weight must be an integer >= 0, got {weight!r}")
        if self.split and sum(weight for _, weight in self.split) != 100:
            raise ValueError(f"{entry}: split: the weights must sum to 100, not "
                             f"{sum(weight for _, weight in self.split)}")

    def version(self, name: str) -> ModelVersion | None:
        """The version called `name`, if there is one."""
        return next((version for version in self.versions if version.name == name), None)

    @property
    def weights(self) -> tuple[tuple[ModelVersion, int], ...]:
        """Each version a request for the name may get, with its weight (the first version alone
        without a split; versions weighted 0 left out)."""
        if not self.split:
            return ((self.versions[0], 100),)
        return tuple((version, weight) for name, weight in self.split
                     if weight > 0 and (version := self.version(name)) is not None)


@dataclass(frozen=True)
class ModelRepository:
    """Every model of a deployment, from its repository file."""

    models: tuple[RepositoryModel, ...]
    source: str = ""  # the file it was read from

    def __post_init__(self) -> None:
        names = [model.name for model in self.models]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"{self.source}: model: {', '.join(duplicates)} listed more than once")
        pools = [version.pool for model in self.models for version in model.versions]
        shared = sorted({pool for pool in pools if pools.count(pool) > 1})
        if shared:
            raise ValueError(f"{self.source}: pool: {', '.join(shared)} is assigned more than one version")
        if not self.models:
            raise ValueError(f"{self.source}: no [[model]] entry")
        taken = set(names) | {version.version_key for version in self.versions}
        for base, adapter in self.adapters:
            if adapter.name in taken:
                raise ValueError(f"{self.source}: {base} adapter {adapter.name!r}: name: already the name of a "
                                 "model, a version or another adapter")
            taken.add(adapter.name)

    @property
    def adapters(self) -> tuple[tuple[str, RepositoryAdapter], ...]:
        """Every LoRA adapter, with its base version's NAME@VERSION, in the file's order."""
        return tuple((version.version_key, adapter) for version in self.versions for adapter in version.adapters)

    @property
    def versions(self) -> tuple[ModelVersion, ...]:
        """Every version of every model, in the file's order."""
        return tuple(version for model in self.models for version in model.versions)

    def model(self, name: str) -> RepositoryModel | None:
        """The model called `name`, if there is one."""
        return next((model for model in self.models if model.name == name), None)

    def find(self, key: str) -> ModelVersion:
        """The version `NAME@VERSION` names; ValueError naming what is unknown."""
        name, at, version_name = key.partition("@")
        model = self.model(name)
        if not at or not version_name:
            raise ValueError(f"{key!r}: name a version as NAME@VERSION")
        if model is None:
            raise ValueError(f"{key!r}: no model {name!r} in {self.source} (models: "
                             f"{', '.join(m.name for m in self.models)})")
        version = model.version(version_name)
        if version is None:
            raise ValueError(f"{key!r}: model {name!r} has no version {version_name!r} (versions: "
                             f"{', '.join(v.name for v in model.versions)})")
        return version

    def for_pool(self, pool: str) -> ModelVersion:
        """The version the repository assigns to `pool`; ValueError when none."""
        version = next((version for version in self.versions if version.pool == pool), None)
        if version is None:
            raise ValueError(f"--pool: {self.source} assigns no version to pool {pool!r} (pools: "
                             f"{', '.join(v.pool for v in self.versions)})")
        return version


def load_repository(path: str) -> ModelRepository:
    """The repository in the TOML file at `path`; ValueError naming the entry and field at fault."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as error:
        raise ValueError(f"--model-repository: cannot read {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"--model-repository: {path} is not valid TOML: {error}") from None
    return parse_repository(document, path)


def parse_repository(document: dict[str, Any], source: str) -> ModelRepository:
    """The repository a parsed TOML document describes (paths relative to `source`'s folder)."""
    unknown = set(document) - {"model"}
    if unknown:
        raise ValueError(f"{source}: unknown top-level keys: {', '.join(sorted(unknown))} (expected [[model]])")
    models = document.get("model", [])
    if not isinstance(models, list):
        raise ValueError(f"{source}: model: expected [[model]] tables")
    folder = os.path.dirname(os.path.abspath(source))
    return ModelRepository(tuple(_model(entry, index, folder) for index, entry in enumerate(models)),
                           source)


def _model(entry: dict[str, Any], index: int, folder: str) -> RepositoryModel:
    where = f"model {entry.get('name', f'#{index + 1}')!r}"
    _known(where, entry, _MODEL_FIELDS)
    name = _check_name(where, entry.get("name"))
    split = entry.get("split", {})
    if not isinstance(split, dict):
        raise ValueError(f"{where}: split: expected a table of version = weight")
    versions = entry.get("version", [])
    if not isinstance(versions, list):
        raise ValueError(f"{where}: version: expected [[model.version]] tables")
    return RepositoryModel(name, tuple(_version(name, version, number, folder)
                                       for number, version in enumerate(versions)),
                           tuple(split.items()))


def _version(model: str, entry: dict[str, Any], index: int, folder: str) -> ModelVersion:
    where = f"model {model!r} version {entry.get('name', f'#{index + 1}')!r}"
    _known(where, entry, _VERSION_FIELDS)
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: path: required (a GGUF file, an HF directory, or {SHIPPED!r})")
    fields = {name: entry[name] for name in _VERSION_FIELDS - {"name", "path", "adapter"} if name in entry}
    adapters = entry.get("adapter", [])
    if not isinstance(adapters, list):
        raise ValueError(f"{where}: adapter: expected [[model.version.adapter]] tables")
    return ModelVersion(model, _check_name(where, entry.get("name")),
                        path if path == SHIPPED else os.path.join(folder, os.path.expanduser(path)), **fields,
                        adapters=tuple(_adapter(where, adapter, folder) for adapter in adapters))


def _adapter(version: str, entry: dict[str, Any], folder: str) -> RepositoryAdapter:
    where = f"{version} adapter {entry.get('name', '?')!r}" if isinstance(entry, dict) else f"{version} adapter"
    _known(where, entry, _ADAPTER_FIELDS)
    name = _check_name(where, entry.get("name"))
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: path: required (a PEFT adapter's directory)")
    path = os.path.join(folder, os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ValueError(f"{where}: path: {path} is not a directory")
    return RepositoryAdapter(name, path)


def _known(where: str, entry: object, allowed: frozenset[str]) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a table")
    unknown = set(entry) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown fields: {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(sorted(allowed))})")


__all__ = ["SHIPPED", "ModelRepository", "ModelVersion", "RepositoryAdapter", "RepositoryModel", "load_repository"]
