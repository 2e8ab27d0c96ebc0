"""Model repository files the tests and benchmarks share: the shipped model as two versions, its own
4-bit blocks ("q4") and exact float32 ("fp32")."""

from __future__ import annotations


def two_versions(split: str = "q4 = 50, fp32 = 50", fp32_extra: str = "", name: str = "smollm2") -> str:
    """The TOML text of model `name`, with `split` and more `fp32` fields (TOML lines) as given;
    files of several models are these texts joined."""
    return f"""
[[model]]
name = "{name}"
split = {{ {split} }}

[[model.version]]
name = "q4"
path = "shipped"

[[model.version]]
name = "fp32"
path = "shipped"
dtype = "float32"
quantization = "none"
{fp32_extra}
"""
