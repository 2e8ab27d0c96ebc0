"""Hypothesis profiles for every property test, chosen by TANDEM_FUZZ (conftest loads it):

- `ci` (the default): derandomized, no example database, each test's bounded number of examples,
  so that a run is short and repeatable;
- `fuzz` (`make fuzz`): fresh random seeds and FUZZ_SCALE times the examples, to look for new bugs.

A test states its examples through `examples(n)`, so the profile can scale them.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV_VAR = "TANDEM_FUZZ"
FUZZ_SCALE = 10
_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("ci", derandomize=True, database=None, deadline=None, suppress_health_check=_SLOW_IS_FINE)
settings.register_profile("fuzz", derandomize=False, database=None, deadline=None, suppress_health_check=_SLOW_IS_FINE,
                          print_blob=True)


def profile() -> str:
    """The profile TANDEM_FUZZ names; ValueError for another one."""
    name = os.environ.get(ENV_VAR, "ci")
    if name not in ("ci", "fuzz"):
        raise ValueError(f"{ENV_VAR}={name!r}: one of ci, fuzz")
    return name


def load() -> None:
    settings.load_profile(profile())


def examples(n: int) -> int:
    """The examples a test of `n` examples runs under the profile."""
    return n * FUZZ_SCALE if profile() == "fuzz" else n
