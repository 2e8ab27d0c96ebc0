"""A model product with LoRA: the base product over the whole batch, plus the low-rank terms of
the step's adapter slots, in the step's form (engine.lora.batch): segmented, by the CPU kernel over
each slot's rows (all of a product's modules in one call); grouped, per slot over that slot's rows
only; masked, over every row through the slots the step spans, each row's own kept.

The base product runs once for every row whatever its adapter, in the base's own weight format
(GGUF blocks, int8, bf16, fp32), so adapters never multiply the base's cost; each adapter adds two
thin products, (x·Aᵀ)·Bᵀ, per module of the fused product.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from engine.lora.batch import NO_LORA, LoraBatch
from engine.lora.slots import LoraSlots, ModuleSlots

Product = Callable[[torch.Tensor], torch.Tensor]
# (y, x, each module's A, B and first column, order, segments, each slot's rank): adds the segmented
# form's terms to y in place (the CPU kernels' lora_add_, engine/model/kernels/lora_bgmv.cpp).
LoraAdd = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[int], torch.Tensor,
                    torch.Tensor, list[int]], None]


class LoraStep:
    """The step being computed's rows by slot, set by the runner around its forward and read by every
    LoRA product (one object per model, so each product needs no argument of its own)."""

    def __init__(self) -> None:
        self.batch: LoraBatch = NO_LORA
        self._slots: LoraSlots | None = None
        self.lora_add: LoraAdd | None = None

    def attach(self, slots: LoraSlots, lora_add: LoraAdd | None) -> None:
        """Serve `slots` (their width, dtype and device shape the masked form), small steps through
        `lora_add` where there is one (the model's plan has the CPU kernels')."""
        self._slots, self.lora_add = slots, lora_add

    @contextlib.contextmanager
    def running(self, slots: Sequence[int | None], rows: Sequence[int]) -> Iterator[None]:
        """One forward pass's rows by slot, from each sequence's slot (None: the base; no slots at all:
        an engine without adapters) and rows; NO_LORA again after it, whatever happens."""
        held = self._slots
        self.batch = NO_LORA if not slots or held is None else LoraBatch.of(
            list(zip(slots, rows, strict=True)), held.width, held.dtype, self.lora_add is not None, held.device)
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
        # The kernel's arguments that never change.
        self._a = [module.a for module in modules]
        self._b = [module.b for module in modules]
        self._columns = [module.columns.start for module in modules]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch, lora_add = self._step.batch, self._step.lora_add
        if batch.order is not None and batch.segments is not None and lora_add is not None:
            lora_add(y, x.to(self._a[0].dtype), self._a, self._b, self._columns, batch.order, batch.segments,
                     self._ranks)
            return y
        if batch.mask is not None:
            for module in self._modules:
                a = module.a[:, batch.span].flatten(1, 2)  # [in, slots x width], a view
                b = module.b[batch.span].flatten(0, 1)  # [slots x width, out]
                delta = ((x.to(a.dtype) @ a) * batch.mask) @ b
                y[:, module.columns] += delta.to(y.dtype)
            return y
        for group in batch.groups:
            rank = self._ranks[group.slot]
            if not rank:
                continue
            rows = x[group.rows]
            for module in self._modules:
                a = module.a[:, group.slot, :rank]
                b = module.b[group.slot, :rank]
                delta = (rows.to(a.dtype) @ a) @ b
                if isinstance(group.rows, slice):
                    y[group.rows, module.columns] += delta.to(y.dtype)
                else:
                    y[:, module.columns].index_add_(0, group.rows, delta.to(y.dtype))
        return y
