"""Which version of a model serves a request that names only the model: the A/B (or canary) split.

Sticky per caller: the same caller (the OpenAI `user` field, else the API key's name) always lands on
the same version while the weights stay the same, so one user sees one version; a request with no
caller draws afresh. The caller's hash picks a percentile, and the versions' weights cover the
percentiles in the repository's order, so moving 10 points from one version to another moves only
the callers in those 10 points.
"""

from __future__ import annotations

import hashlib
import random

from services.repository.config import ModelVersion, RepositoryModel


def percentile(model: str, caller: str) -> int:
    """The caller's fixed place, 0 to 99, in `model`'s split (a stable hash, the same in every process)."""
    digest = hashlib.sha256(f"{model}\0{caller}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100


def choose_version(model: RepositoryModel, caller: str | None, draw: random.Random | None = None) -> ModelVersion:
    """The version a request for `model` gets: by the caller's percentile, or a random one (from
    `draw`) without a caller."""
    weights = model.weights
    point = percentile(model.name, caller) if caller else (draw or random).randrange(100)
    total = sum(weight for _, weight in weights)
    point = point * total // 100
    for version, weight in weights:
        if point < weight:
            return version
        point -= weight
    return weights[-1][0]
