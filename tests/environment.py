"""Skips for what a machine may lack (a tool, a library, a kernel build, root's network namespaces).

Elsewhere such a test skips, naming what is missing; under CI=true it fails instead: CI runs as root
on the kind of machine the suite is written for, which has all of it, so a skip there would be a
check that silently did not run (a failed kernel build, a library that did not install).
Skips that depend on the hardware (a GPU, NVML) or that a CPU rightly takes another path for (AMX)
stay plain skips: CI's machine lacks a GPU, and the other path is tested instead.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import NoReturn

import pytest

MARK = "ci_must_have"  # a test carrying it, under CI, fails with the mark's reason (conftest)


def under_ci() -> bool:
    return os.environ.get("CI") == "true"


def missing(what: str) -> NoReturn:
    """Skip the running test (fail it under CI): this machine lacks `what`."""
    if under_ci():
        pytest.fail(f"CI's machine must have it: {what}")
    pytest.skip(what)


def needs(present: bool, what: str) -> pytest.MarkDecorator:
    """A mark for a test that needs `present` (else it skips naming `what`; under CI it fails)."""
    if present:
        return pytest.mark.skipif(False, reason=what)
    if under_ci():
        return getattr(pytest.mark, MARK)(what)
    return pytest.mark.skipif(True, reason=what)


def import_or_missing(name: str) -> ModuleType:
    """The module `name`, or `missing` it."""
    try:
        return __import__(name)
    except ImportError as error:
        missing(f"{name} cannot be imported: {error}")
