"""The number formats the served models run in, as the workers' load reports say: what `/v1/models`
shows beside each model version (the gateway loads no weights, so it learns them from the workers)."""

from __future__ import annotations

from collections.abc import Iterable

from tandem.v1 import common_pb2

# The LoadReport fields that name a format, in the order /v1/models lists them.
FORMAT_FIELDS = ("dtype", "quantization", "cpu_weights", "kv_cache_dtype", "activation_quantization")


def served_formats(reports: Iterable[common_pb2.LoadReport]) -> dict[str, str | None]:
    """Each format field as the workers report it: their one value, or, where workers differ (a
    deployment of mixed machines), their distinct values sorted and comma-separated; None while no
    report carries it."""
    values: dict[str, set[str]] = {name: set() for name in FORMAT_FIELDS}
    for report in reports:
        for name in FORMAT_FIELDS:
            if value := getattr(report, name):
                values[name].add(value)
    return {name: ",".join(sorted(found)) or None for name, found in values.items()}
