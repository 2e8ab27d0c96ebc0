"""A model product with LoRA: the base product over the whole batch, plus the low-rank terms of
the step's adapter slots, in the step's form (engine.lora.batch): grouped, per slot over that
slot's rows only; masked, over every row through the slots the step spans, each row's own kept.

The base product runs once for every row whatever its adapter, in the base's own weight format
(GGUF blocks, int8, bf16, fp32), so adapters never multiply the base's cost; each adapter adds two
thin products, (x·Aᵀ)·Bᵀ, per module of the fused product.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from engine.lora.batch import NO_LORA, LoraBatch
from engine.lora.slots import ModuleSlots

Product = Callable[[torch.Tensor], torch.Tensor]


class LoraStep:
    """The step being computed's rows by slot, set by the runner around its forward and read by every
    LoRA product (one object per model, so each product needs no argument of its own)."""

    def __init__(self) -> None:
        self.batch: LoraBatch = NO_LORA
        # The slots' rank rows and dtype (set when the slots are attached): the masked form's shape.
        self.max_rank = 0
        self.dtype = torch.float32

    @contextlib.contextmanager
    def running(self, slots: Sequence[int | None], rows: Sequence[int]) -> Iterator[None]:
        """One forward pass's rows by slot, from each sequence's slot (None: the base; no slots at all:
        an engine without adapters) and rows; NO_LORA again after it, whatever happens."""
        self.batch = LoraBatch.of(list(zip(slots, rows, strict=True)), self.max_rank, self.dtype) if slots \
            else NO_LORA
        try:
            yield
        finally:
            self.batch = NO_LORA


class LoraProduct:
    """`base` plus the LoRA terms of the slots in `step` for `modules` (the product's PEFT modules)."""

    def __init__(self, base: Product, modules: tuple[ModuleSlots, ...], ranks: list[int], step: LoraStep) -> None:
        self.base = base
        self._modules = modules
        self._ranks = ranks  # the slots' ranks (LoraSlots.ranks: changes as adapters load)
        self._step = step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self._step.batch
        if batch.mask is not None:
            for module in self._modules:
                rank = module.a.shape[1]  # the slots' max rank
                a = module.a[batch.span].flatten(0, 1)  # [slots x rank, in], a view
                b = module.b.flatten(1, 2)[:, batch.span.start * rank:batch.span.stop * rank]  # [out, slots x rank]
                delta = ((x.to(a.dtype) @ a.T) * batch.mask) @ b.T
                y[:, module.columns] += delta.to(y.dtype)
            return y
        for group in batch.groups:
            rank = self._ranks[group.slot]
            if not rank:
                continue
            rows = x[group.rows]
            for module in self._modules:
                a = module.a[group.slot, :rank]
                b = module.b[:, group.slot, :rank]
                delta = (rows.to(a.dtype) @ a.T) @ b.T
                if isinstance(group.rows, slice):
                    y[group.rows, module.columns] += delta.to(y.dtype)
                else:
                    y[:, module.columns].index_add_(0, group.rows, delta.to(y.dtype))
        return y
