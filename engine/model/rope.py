"""Rotary position embedding in the rotate-half (HF) convention, with HF's frequency scaling variants."""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2] in float32, computed as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    # Dynamic NTK only rescales the base once the context outgrows max_position_embeddings; the cache
    # covers exactly that range, where transformers leaves the frequencies unscaled.
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones are kept, the band between is interpolated.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, computed once, indexed by position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        angles = torch.arange(config.max_position_embeddings, dtype=torch.float)[:, None] * inv_freq[None, :]
        # Half-width tables: rotate-half applies the same angle to dimension j and j + head_dim // 2.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim // 2] for the given positions, ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the angles whose cos/sin are given (rotate-half pairing)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class RotaryAtAnyPosition:
    """The rotary embedding at any positions, negative or past the model's table, computed as
    RotaryEmbedding's table is (StreamingLLM's attention rotates at positions within the cache, a
    prompt chunk's in a frame of its own: engine.attention.streaming)."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] rotated at `positions` [n], in float32 and returned in x's dtype."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return apply_rotary(x.float(), angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)).to(x.dtype)
