"""Unit tests compute in this process with every core: they run after the integration modules have
stopped their worker processes (tests/integration/conftest.py), so nothing else wants the cores.
A module whose tests run tensor-parallel ranks as processes of their own marks itself `ranks`: it
keeps one thread here, as more beside the ranks' would oversubscribe the cores, where OpenMP's
spinning threads slow a step tenfold."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ranks: the test runs tensor-parallel ranks as processes (one thread here)")


@pytest.fixture(autouse=True)
def _threads(request: pytest.FixtureRequest) -> None:
    # Set before each test, so that a module asking for one thread does not leave the session on one.
    torch.set_num_threads(1 if request.node.get_closest_marker("ranks") else os.cpu_count() or 1)
