"""Chooses the attention backend for a device: Triton kernels where they run, torch elsewhere."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import cache
from typing import Literal

import torch

from engine.attention.metadata import AttentionBackend
from engine.attention.reference import DenseDecode, DensePrefill, TorchPagedAttention, paged_decode_attention
from engine.attention.streaming import Rotate, StreamingAttention
from engine.kv_cache.codec import DENSE, FP8_E4M3, KVCodec
from engine.kv_cache.window import KVWindow

logger = logging.getLogger(__name__)

# The spellings Triton itself reads as true for boolean environment switches.
_TRUE_SPELLINGS = ("1", "true", "on", "yes")


def triton_unsupported_reason(device: str, environ: Mapping[str, str]) -> str | None:
    """Why the Triton backend cannot target `device` under `environ`, or None when it can be tried.

    On CPU the kernels run only in Triton's interpreter, which Triton enables per kernel when the
    kernel module is imported, so TRITON_INTERPRET must be set before the engine starts.
    """
    device_type = torch.device(device).type
    if device_type == "cpu":
        if environ.get("TRITON_INTERPRET", "").lower() not in _TRUE_SPELLINGS:
            return "Triton runs on CPU only in its interpreter; set TRITON_INTERPRET=1 before starting"
        return None
    if device_type != "cuda":
        return f"Triton kernels need a CUDA device, not {device_type!r}"
    return None


def triton_kv_unsupported_reason(codec: KVCodec, capability: tuple[int, int] | None) -> str | None:
    """Why the Triton kernels cannot read a `codec` cache on an NVIDIA GPU of compute `capability`
    (None: not an NVIDIA GPU), or None. Triton has fp8 e4m3 loads from compute capability 8.9 on."""
    if codec is FP8_E4M3 and capability is not None and capability < (8, 9):
        return f"Triton reads fp8 e4m3 on compute capability 8.9 and up, this GPU is {capability[0]}.{capability[1]}"
    return None


def _nvidia_capability(device: str) -> tuple[int, int] | None:
    if torch.device(device).type != "cuda" or torch.version.hip is not None:
        return None
    return torch.cuda.get_device_capability(device)


@cache
def _triton_failure(device: str, codec: KVCodec) -> str | None:
    """Run the decode kernel once on a tiny batch, over a cache written through `codec`; the error
    (or wrong answer) it gives, if any."""
    try:
        from engine.attention.triton_paged import triton_paged_decode_attention

        generator = torch.Generator().manual_seed(0)
        # head_dim 32: two int4 scale groups (engine.kv_cache.codec.INT4_GROUP).
        k_cache, v_cache = torch.randn(2, 2, 16, 2, 32, generator=generator).to(device).unbind(0)
        k_cache, v_cache = codec.encode(k_cache), codec.encode(v_cache)
        q = torch.randn(2, 4, 32, generator=generator).to(device)
        block_tables = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([19, 7], dtype=torch.int32, device=device)
        got = triton_paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25, codec)
        want = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25, codec)
    except Exception as error:  # any failure to import, compile or launch means "does not work"
        return f"{type(error).__name__}: {error}"
    if not torch.allclose(got, want, atol=1e-3, rtol=1e-3):
        return "the decode kernel disagrees with the torch reference"
    return None


def select_attention_backend(
    name: Literal["auto", "torch", "triton"], device: str, codec: KVCodec = DENSE,
    dense_decode: DenseDecode | None = None, dense_prefill: DensePrefill | None = None,
) -> AttentionBackend:
    """The backend called `name` for `device`, reading and writing the cache through `codec`; "auto"
    prefers Triton on CUDA when it imports and works (torch reads every KV format on every device).
    The torch backend runs decode batches over a dense cache through `dense_decode` and bf16 prompt
    chunks through `dense_prefill` when given.

    Raises ValueError for an unknown name, for "triton" where its kernels cannot run, and (naming
    kv_cache_dtype) for "triton" with a KV format its kernels cannot read on this device.
    """
    if name == "torch":
        return TorchPagedAttention(codec, dense_decode, dense_prefill)
    if name not in ("auto", "triton"):
        raise ValueError(f"unknown attention backend {name!r}")
    is_cuda = torch.device(device).type == "cuda"
    if name == "auto" and not is_cuda:
        # The interpreter is far slower than torch, so CPU only gets Triton when asked by name.
        return TorchPagedAttention(codec, dense_decode, dense_prefill)
    kv_reason = triton_kv_unsupported_reason(codec, _nvidia_capability(device))
    if kv_reason is not None and name == "triton":
        raise ValueError(f"kv_cache_dtype: {FP8_E4M3.name} has no kernel for attention backend 'triton' on {device} "
                         f"({kv_reason}; supported there: auto, int8, or attention backend torch)")
    reason = kv_reason or triton_unsupported_reason(device, os.environ) or _triton_failure(device, codec)
    if reason is None:
        from engine.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention(codec)
    if name == "triton":
        raise ValueError(f"attention backend 'triton' is unavailable on {device}: {reason}")
    logger.warning("falling back to the torch attention backend on %s: %s", device, reason)
    return TorchPagedAttention(codec)


def windowed_attention(backend: AttentionBackend, window: KVWindow, rotate: Rotate) -> AttentionBackend:
    """`backend`'s kind, attending through `window`. The torch backend loses the CPU kernels' ops
    (decode_attention.cpp, prefill_attention.cpp, and with them the decode stack, which needs the
    decode op): they attend over whole contexts, and a window's freed blocks must never be read, so a
    windowed model takes torch's gathers of only the blocks it holds instead. StreamingLLM's window
    (positions within the cache) is torch's on every device: only it rotates keys as it reads them,
    by `rotate` (the model's rotary embedding)."""
    if window.cache_positions:
        if not isinstance(backend, TorchPagedAttention):
            logger.warning("kv_sliding_window: the torch attention backend serves it (keys are rotated at their "
                           "positions within the cache as they are read), not %s", backend.name)
        return StreamingAttention(backend.codec, window, rotate)
    if isinstance(backend, TorchPagedAttention):
        return TorchPagedAttention(backend.codec, window=window)
    from engine.attention.triton_paged import TritonPagedAttention

    if isinstance(backend, TritonPagedAttention):
        return TritonPagedAttention(backend.codec, window)
    raise ValueError(f"attention backend {backend.name!r} has no sliding window")
