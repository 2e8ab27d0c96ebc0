"""The model repository file (services.repository): what it accepts, what it refuses by name, and
how a model's split picks a version, sticky per caller."""

from __future__ import annotations

import argparse
import random
from collections import Counter

import pytest

from harness.repository_files import two_versions
from services.commands.engine_flags import EngineFlags, engine_config
from services.common.config_flags import add_flags, from_args
from services.gateway.catalog import ModelCatalog, UnknownModel
from services.gateway.model import ServedModel
from services.repository.config import load_repository, parse_repository
from services.repository.split import choose_version, percentile

GOOD = two_versions("q4 = 90, fp32 = 10", 'max_model_len = 1024\npool = "exact"')


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return str(path)


def _version(name: str, **fields: object) -> dict:
    return {"name": name, "path": "shipped", **fields}


def _parse(*versions: dict, split: dict | None = None, name: str = "m") -> object:
    model: dict = {"name": name, "version": list(versions)}
    if split is not None:
        model["split"] = split
    return parse_repository({"model": [model]}, "models.toml")


def test_a_repository_file_names_its_versions_pools_and_split(tmp_path):
    repository = load_repository(_write(tmp_path, GOOD))
    model = repository.model("smollm2")
    assert [version.version_key for version in repository.versions] == ["smollm2@q4", "smollm2@fp32"]
    assert repository.find("smollm2@fp32").dtype == "float32"
    assert repository.for_pool("smollm2-q4").name == "q4"  # the default pool name
    assert repository.for_pool("exact").name == "fp32"
    assert [(version.name, weight) for version, weight in model.weights] == [("q4", 90), ("fp32", 10)]


def test_a_path_is_read_relative_to_the_repository_file(tmp_path):
    (tmp_path / "weights.gguf").write_bytes(b"")
    repository = parse_repository({"model": [{"name": "m", "version": [_version("v", path="weights.gguf")]}]},
                                  str(tmp_path / "models.toml"))
    assert repository.versions[0].weights == str(tmp_path / "weights.gguf")


@pytest.mark.parametrize(("versions", "split", "message"), [
    ([_version("v"), _version("v")], None, "model 'm': version: v listed more than once"),
    ([_version("v", path="missing.gguf")], None, "model 'm' version 'v': path: "),
    ([_version("a"), _version("b")], {"a": 90, "b": 20}, "model 'm': split: the weights must sum to 100, not 110"),
    ([_version("a")], {"a": 90, "c": 10}, "model 'm': split: no version 'c'"),
    ([_version("a", dtype="fp64")], None, "model 'm' version 'a': dtype: 'fp64' is not one of"),
    ([_version("a", colour="red")], None, "model 'm' version 'a': unknown fields: colour"),
    ([_version("a", max_model_len=0)], None, "model 'm' version 'a': max_model_len: must be a positive integer"),
    ([{"name": "a"}], None, "model 'm' version 'a': path: required"),
    ([], None, "model 'm': version: at least one version is required"),
    ([_version("a b")], None, "model 'm' version 'a b': name: must be"),
    ([_version("a", pool="p"), _version("b", pool="p")], None,
     "models.toml: pool: p is assigned more than one version"),
])
def test_a_bad_repository_is_refused_naming_the_entry_and_field(versions, split, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        _parse(*versions, split=split)


def test_a_repository_without_models_or_listing_one_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no \\[\\[model\\]\\] entry"):
        parse_repository({}, "models.toml")
    twice = {"model": [{"name": "m", "version": [_version("a")]}, {"name": "m", "version": [_version("b")]}]}
    with pytest.raises(ValueError, match="model: m listed more than once"):
        parse_repository(twice, "models.toml")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_repository(_write(tmp_path, "[[model]\n"))


def test_a_split_is_sticky_per_caller_and_follows_its_weights():
    model = _parse(_version("a"), _version("b"), split={"a": 90, "b": 10}).models[0]
    for caller in ("alice", "bob", "carol"):
        assert len({choose_version(model, caller).name for _ in range(5)}) == 1
    callers = Counter(choose_version(model, f"user-{index}").name for index in range(2000))
    assert 1700 < callers["a"] < 1900  # 90% by hash, within sampling noise
    # Moving the split moves only the callers in the points that changed hands.
    wider = _parse(_version("a"), _version("b"), split={"a": 50, "b": 50}).models[0]
    for index in range(500):
        caller = f"user-{index}"
        if choose_version(model, caller).name == "b":
            assert choose_version(wider, caller).name == "b"
    assert percentile("m", "alice") == percentile("m", "alice")
    # Without a caller, each request draws; a weight of 0 is never drawn.
    draw = random.Random(7)
    off = _parse(_version("a"), _version("b"), split={"a": 100, "b": 0}).models[0]
    assert {choose_version(off, None, draw).name for _ in range(200)} == {"a"}


def test_a_name_without_a_split_routes_to_its_first_version():
    model = _parse(_version("first"), _version("second")).models[0]
    assert {choose_version(model, f"user-{index}").name for index in range(50)} == {"first"}


def test_the_catalog_resolves_names_and_versions(tokenizer, tmp_path):
    repository = load_repository(_write(tmp_path, GOOD))
    from services.gateway.catalog import CatalogEntry

    catalog = ModelCatalog([CatalogEntry(ServedModel("smollm2", 1024, tokenizer), version)
                            for version in repository.versions], repository)
    exact = catalog.resolve("smollm2@fp32")
    assert (exact.answered_as, exact.version, exact.version_key, exact.fingerprint) == (
        "smollm2@fp32", "fp32", "smollm2@fp32", "smollm2@fp32")
    assert catalog.resolve("", "alice").answered_as == "smollm2"  # no model named: the first
    with pytest.raises(UnknownModel, match="`other` does not exist"):
        catalog.resolve("other")
    with pytest.raises(UnknownModel, match="has no version `q8`"):
        catalog.resolve("smollm2@q8")
    single = ModelCatalog.single(ServedModel("smollm2", 1024, tokenizer))
    assert single.resolve("").version_key is None
    with pytest.raises(UnknownModel):
        single.resolve("smollm2@q4")


def _flags(*argv: str) -> EngineFlags:
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineFlags)
    return from_args(EngineFlags, parser.parse_args(list(argv)))


def test_a_worker_takes_its_versions_model_and_formats_from_the_repository(tmp_path):
    path = _write(tmp_path, GOOD)
    config = engine_config(_flags("--model-repository", path, "--model-version", "smollm2@fp32"), "decode")
    assert (config.dtype, config.quantization, config.max_model_len) == ("float32", "none", 1024)
    assert (config.served_name, config.model_version) == ("smollm2", "fp32")
    assert engine_config(_flags("--model-repository", path, "--pool", "smollm2-q4"), "prefill").model_version == "q4"
    for argv, message in [
        (("--model-repository", path), "exactly one of --model-version"),
        (("--model-repository", path, "--model-version", "smollm2@q8"), "--model-version: .*no version 'q8'"),
        (("--model-repository", path, "--pool", "nowhere"), "--pool: .* assigns no version to pool 'nowhere'"),
        (("--model-version", "smollm2@q4"), "name the versions' file with --model-repository"),
        (("--model-repository", path, "--model", "x.gguf", "--pool", "exact"), "--model: the repository"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine_config(_flags(*argv), "decode")


def test_a_split_set_at_run_time_is_checked_as_the_file_would_be(tokenizer, tmp_path):
    from services.gateway.catalog import CatalogEntry

    repository = load_repository(_write(tmp_path, GOOD))
    catalog = ModelCatalog([CatalogEntry(ServedModel("smollm2", 1024, tokenizer), version)
                            for version in repository.versions], repository)
    moved = catalog.with_split("smollm2", {"q4": 0, "fp32": 100})
    assert moved.resolve("smollm2", "anyone").version == "fp32"
    assert catalog.resolve("smollm2", "anyone").version_key is not None  # the original is unchanged
    with pytest.raises(ValueError, match="must sum to 100"):
        catalog.with_split("smollm2", {"q4": 10})
    with pytest.raises(UnknownModel):
        catalog.with_split("llama", {"q4": 100})
    with pytest.raises(UnknownModel):
        ModelCatalog.single(ServedModel("smollm2", 1024, tokenizer)).with_split("smollm2", {"q4": 100})


def test_a_version_whose_weights_do_not_match_their_architecture_is_refused_by_name(tmp_path):
    import json

    from test_model_hf import CONFIGS, VOCAB, save_random_model, save_word_tokenizer

    from services.common.worker import load_engine

    weights = tmp_path / "bad"
    save_random_model(CONFIGS["llama_gqa_tied"](), weights)
    save_word_tokenizer(weights, VOCAB)
    config = json.loads((weights / "config.json").read_text())
    (weights / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))  # the MLP is 112 wide
    repository = _write(tmp_path, '[[model]]\nname = "m"\n[[model.version]]\nname = "bad"\npath = "bad"\n')
    engine_config_ = engine_config(_flags("--model-repository", repository, "--model-version", "m@bad",
                                          "--dtype", "float32"), "colocated")
    with pytest.raises(ValueError, match=r"model repository version m@bad \(.*bad\) does not load: .*mlp"):
        load_engine(engine_config_)
