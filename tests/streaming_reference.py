"""StreamingLLM as its paper defines it, token by token on a transformers Llama's own modules (tests
only): the cache keeps the first `sinks` tokens and the last `window` (the new one included), its
keys stored before the rotary embedding, and each step rotates them and the query "at positions
within the cache rather than those in the original text" (Xiao et al., 2023, section 3.2), as the
authors' perplexity evaluation feeds one token at a time. With `cache_positions=False` the same cache
rotates keys at their positions in the text: what an engine that kept absolute positions computes.
`round_trip` stands for a KV format: each key (unrotated) and value as its pages give it back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class StreamingReference:
    """One sequence's StreamingLLM cache over `model` (a transformers LlamaForCausalLM)."""

    def __init__(self, model: torch.nn.Module, sinks: int, window: int, cache_positions: bool = True,
                 round_trip: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.model, self.sinks, self.window, self.cache_positions = model, sinks, window, cache_positions
        self.round_trip = round_trip or (lambda x: x)
        self.layers: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in model.model.layers]
        self.position = 0

    @torch.inference_mode()
    def feed(self, token: int) -> torch.Tensor:
        """The next token's logits [vocab] after `token`, which joins the cache."""
        config = self.model.config
        head_dim = config.hidden_size // config.num_attention_heads
        hidden = self.model.model.embed_tokens(torch.tensor([[token]]))
        for layer, cache in zip(self.model.model.layers, self.layers, strict=True):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(1, 1, -1, head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(1, 1, -1, head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(1, 1, -1, head_dim).transpose(1, 2)
            cache.append((self.position, self.round_trip(k), self.round_trip(v)))
            if len(cache) > self.sinks + self.window:  # evict the oldest token past the sinks
                del cache[self.sinks]
            positions = (torch.arange(len(cache)) if self.cache_positions
                         else torch.tensor([text for text, _, _ in cache]))
            cos, sin = self.model.model.rotary_emb(v, positions[None])
            keys = torch.cat([key for _, key, _ in cache], dim=2)
            values = torch.cat([value for _, _, value in cache], dim=2)
            _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
            query, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
            groups = config.num_attention_heads // config.num_key_value_heads
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            weights = torch.softmax(query @ keys.transpose(2, 3) * head_dim**-0.5, dim=-1)
            out = (weights @ values).transpose(1, 2).reshape(1, 1, -1)
            hidden = hidden + attention.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.position += 1
        return self.model.lm_head(self.model.model.norm(hidden))[0, 0].float()


def streaming_logits(model: torch.nn.Module, tokens: list[int], sinks: int, window: int,
                     cache_positions: bool = True,
                     round_trip: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Each token's next-token logits [len(tokens), vocab], fed one at a time."""
    reference = StreamingReference(model, sinks, window, cache_positions, round_trip)
    return torch.stack([reference.feed(token) for token in tokens])


def streaming_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int, sinks: int,
                     window: int) -> tuple[list[int], list[float]]:
    """Greedy tokens after `prompt` and each step's top-2 logit margin."""
    reference = StreamingReference(model, sinks, window)
    for token in prompt[:-1]:
        reference.feed(token)
    tokens, margins, last = [], [], prompt[-1]
    for _ in range(max_tokens):
        top = reference.feed(last).topk(2)
        last = int(top.indices[0])
        tokens.append(last)
        margins.append(float(top.values[0] - top.values[1]))
    return tokens, margins
