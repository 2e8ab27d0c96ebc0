"""A KV setting a benchmark runs workers under: the KV format of their pages (`--kv-cache-dtype`)
and optionally a sliding window with attention sinks (`--kv-sliding-window`, `--kv-sink-tokens`) or
a per-request KV budget (`--kv-budget-tokens`, its recent window half of it), spelled as one word
for a comma-separated list:

    float32            the model's own dtype (--kv-cache-dtype auto on a float32 model; the links
                       suite's workers run at float32, the goodput suite's at the engine's --dtype
                       auto: bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, whose word is then
                       bfloat16; `auto` names the workers' dtype either way)
    int4               --kv-cache-dtype int4 (any format of engine.kv_cache.codec; fp8 is fp8_e4m3)
    int8+w256          and --kv-sliding-window 256
    float32+w256+s16   and --kv-sink-tokens 16
    float32+b512       and --kv-budget-tokens 512 (both workers: the prefill side scores the prompt)

Also the arithmetic the links suite prints beside what it measured: ratios against a baseline, and
the time a link's rate alone needs for a number of bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from engine.config import CacheConfig, EngineConfig, KVCacheDType
from engine.footprint import predict_footprint
from engine.kv_cache.codec import kv_format
from harness.hosts import rate_bits

MODEL_DTYPE = "float32"  # the links suite's workers' --dtype: KV "float32" is the model's own
_WORD = re.compile(r"(?P<dtype>[a-z0-9_]+)(?:\+w(?P<window>\d+)(?:\+s(?P<sinks>\d+))?|\+b(?P<budget>\d+))?")


@dataclass(frozen=True)
class KVSetting:
    """A KV format (a KVLayout dtype name) and an optional window of `window` tokens plus `sinks`,
    or an optional budget of `budget` tokens a request, for workers computing in `model_dtype`."""

    dtype: str
    window: int | None = None
    sinks: int = 0
    budget: int | None = None
    model_dtype: str = MODEL_DTYPE

    @classmethod
    def parse(cls, word: str, model_dtype: str = MODEL_DTYPE) -> KVSetting:
        """The setting a word names (see the module docstring) for workers computing in
        `model_dtype`; ValueError naming the flag otherwise."""
        match = _WORD.fullmatch(word.strip())
        if match is None:
            raise ValueError(f"--kv-formats: expected FORMAT[+wWINDOW[+sSINKS]|+bBUDGET] (e.g. int4+w256, "
                             f"float32+b512), got {word!r}")
        dtype = match["dtype"]
        if dtype != model_dtype:
            try:
                dtype = kv_format(dtype, model_dtype).name
            except ValueError as error:
                raise ValueError(f"--kv-formats: {word!r} is neither the workers' dtype ({model_dtype}) nor a KV "
                                 f"format: {error}") from None
        window = int(match["window"]) if match["window"] else None
        budget = int(match["budget"]) if match["budget"] else None
        if window == 0 or budget == 0:
            raise ValueError(f"--kv-formats: {word!r}: the window or budget must be positive")
        return cls(dtype, window, int(match["sinks"] or 0), budget, model_dtype)

    @property
    def label(self) -> str:
        """The setting as `parse` reads it back."""
        window = "" if self.window is None else f"+w{self.window}" + (f"+s{self.sinks}" if self.sinks else "")
        budget = "" if self.budget is None else f"+b{self.budget}"
        return self.dtype + window + budget

    def worker_flags(self) -> list[str]:
        """The flags both workers take (the prefill and the decode side must hold the same pages)."""
        flags = ["--kv-cache-dtype", self._kv_cache_dtype]
        if self.window is not None:
            flags += ["--kv-sliding-window", str(self.window), "--kv-sink-tokens", str(self.sinks)]
        if self.budget is not None:
            flags += ["--kv-budget-tokens", str(self.budget)]
        return flags

    def bytes_per_token(self, model: str | None) -> float:
        """The KV bytes a token takes in this format on `model` (None: the shipped one), every
        layer's K and V, scales included, by the engine's own arithmetic from the model's header.
        A window or budget caps the tokens a request holds, not a token's bytes."""
        block_size = CacheConfig().block_size
        config = EngineConfig(model=model, dtype=self.model_dtype, kv_cache_dtype=self._kv_cache_dtype,
                              cache=CacheConfig(block_size=block_size, num_blocks=1))
        return predict_footprint(config).kv_cache_bytes / block_size

    @property
    def _kv_cache_dtype(self) -> KVCacheDType:
        return "auto" if self.dtype == self.model_dtype else cast(KVCacheDType, self.dtype)


def parse_settings(text: str, model_dtype: str = MODEL_DTYPE) -> list[KVSetting]:
    """A comma-separated list of settings for workers computing in `model_dtype`, the first of them
    the baseline; ValueError for a bad word, an empty list or a setting named twice."""
    settings = [KVSetting.parse(word, model_dtype) for word in text.split(",") if word.strip()]
    if not settings:
        raise ValueError("--kv-formats: name at least one setting")
    labels = [setting.label for setting in settings]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--kv-formats: a setting is named twice in {labels}")
    return settings


BASELINE = KVSetting(MODEL_DTYPE)  # what the ratios of a comparison of settings are against


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, None where either is missing or the baseline is zero."""
    if value is None or not baseline:
        return None
    return value / baseline


def wire_seconds(num_bytes: float, rate: str) -> float:
    """Seconds a link capped at `rate` (tc's words, e.g. "200mbit") needs for `num_bytes` of payload
    alone (no headers): the floor a transfer on it cannot beat."""
    return num_bytes * 8 / rate_bits(rate)
