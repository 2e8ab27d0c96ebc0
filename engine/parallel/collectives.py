"""A rank's model made whole by collectives: the partial sums of the row-parallel products are
all-reduced, the vocabulary-parallel embedding looks up only its own rows and all-reduces, and the
LM head's logits are gathered from every rank (engine.parallel.shard split the weights).

Each wrapper is a product (a callable on a [T, features] tensor), so the model's code does not
change; `TensorParallelSharding` is the model's plan for them (engine.model.llama.Sharding), given
to the model as it is built from a rank's shard. The fused decode stack (engine.model.decode_stack)
runs a whole step without them, so such a model has none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.parallel.layout import TensorParallelLayout

Product = Callable[[torch.Tensor], torch.Tensor]


class AllReduced:
    """A row-parallel product: this rank's partial sum, then the sum over the ranks."""

    def __init__(self, product: Product, group: dist.ProcessGroup) -> None:
        self.product = product
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        self.group.allreduce([out]).wait()
        return out


class VocabParallelEmbedding:
    """The lookup of token ids whose rows this rank holds ([start, start + rows)); every other id's
    row is zero here and comes from its own rank through the all-reduce (one non-zero term each, so
    the sum is exact)."""

    def __init__(self, embed: Product, start: int, rows: int, group: dist.ProcessGroup) -> None:
        self.embed = embed
        self.start = start
        self.rows = rows
        self.group = group

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = self.embed(torch.where(mine, local, 0))
        out = out * mine.unsqueeze(-1).to(out.dtype)
        self.group.allreduce([out]).wait()
        return out


class GatheredLogits:
    """Every rank's logits for its part of the vocabulary, joined in rank order (all ranks get them).
    The parts may differ by one token (engine.parallel.layout): each is padded to the largest for the
    gather, which needs equal sizes, and trimmed after."""

    def __init__(self, shares: list[int], group: dist.ProcessGroup) -> None:
        self.shares = shares
        self.group = group

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        short = max(self.shares) - logits.shape[-1]
        padded = (torch.nn.functional.pad(logits, (0, short)) if short else logits).contiguous()
        parts = [torch.empty_like(padded) for _ in self.shares]
        self.group.allgather([parts], [padded]).wait()
        return torch.cat([part[..., :share] for part, share in zip(parts, self.shares, strict=True)], dim=-1)


class TensorParallelSharding:
    """Rank `layout.rank`'s sharding of the model `config` describes (engine.parallel.shard split its
    weights), with the other ranks of `group`: the model's plan for its collectives."""

    def __init__(self, layout: TensorParallelLayout, config: ModelConfig, group: dist.ProcessGroup) -> None:
        self.group = group
        self.vocabulary = layout.vocabulary(config)
        shares = [len(TensorParallelLayout(layout.size, rank).vocabulary(config)) for rank in range(layout.size)]
        self.gathered = GatheredLogits(shares, group)

    def row_parallel(self, product: Product) -> Product:
        """The product's partial sums all-reduced."""
        return AllReduced(product, self.group)

    def wrap_partial(self, product: Product, wrap: Callable[[Product], Product]) -> Product:
        """`product` with `wrap` around its partial sum if it is row-parallel (all-reduced after it), else
        around it whole."""
        if isinstance(product, AllReduced):
            return AllReduced(wrap(product.product), self.group)
        return wrap(product)

    def embedding(self, embed: Product) -> Product:
        """The lookup of this rank's part of the vocabulary, all-reduced."""
        return VocabParallelEmbedding(embed, self.vocabulary.start, len(self.vocabulary), self.group)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's part of the logits, joined."""
        return self.gathered(logits)
