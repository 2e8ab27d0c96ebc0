"""Session-wide fixtures: the shipped model is loaded once and shared by every test."""

from __future__ import annotations

import os

import fuzzing
import pytest
from environment import MARK

# Tests run on one thread per process unless a test says otherwise: the machine has 2 cores
# and the integration tests start several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU the Triton kernels run in the interpreter; the variable must be set before any
# kernel is decorated, i.e. before the first import of engine.attention.triton_paged.
if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
fuzzing.load()  # derandomized property tests unless TANDEM_FUZZ=fuzz (make fuzz)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(what): CI's machine lacks what the test needs (environment.needs)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(MARK):
        pytest.fail(f"CI's machine must have it: {mark.args[0]}", pytrace=False)


@pytest.fixture(scope="session")
def model_path() -> str:
    """Path of the shipped SmolLM2-135M-Instruct GGUF file."""
    from engine.model.paths import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def model_files(model_path: str):
    """The shipped model's config and fp32 weights, loaded once per session."""
    import torch

    from engine.model.loader import load_model_files

    return load_model_files(model_path, torch.float32)


@pytest.fixture(scope="session")
def tokenizer(model_path: str):
    """The shipped model's tokenizer."""
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_path(model_path)


@pytest.fixture(scope="session")
def make_engine(model_files):
    """Build engines on the session's weights: `make_engine(role=..., cache=..., scheduler=...)`, in
    the pinned formats (reference.PINNED_FORMATS) unless overridden."""
    from reference import PINNED_FORMATS

    from engine.compose import build_engine
    from engine.config import EngineConfig
    from engine.engine import Engine

    def build(**overrides) -> Engine:
        return build_engine(EngineConfig(**{**PINNED_FORMATS, **overrides}), files=model_files)

    return build


@pytest.fixture(scope="session")
def reference_model(model_path: str):
    """transformers' own load of the shipped GGUF (reference.load_reference_model), once per session:
    it dequantizes the file itself, which takes longer than the tests that compare with it."""
    from reference import load_reference_model

    return load_reference_model(model_path)


@pytest.fixture(scope="session")
def reference_tokenizer(model_path: str):
    """transformers' own tokenizer from the shipped GGUF, once per session."""
    from environment import import_or_missing

    transformers = import_or_missing("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(model_path),
                                                      gguf_file=os.path.basename(model_path))
