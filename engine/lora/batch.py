"""Which rows of a step's packed batch go through which adapter slot: computed once per step by
the runner, read by every LoRA product of every layer, in one of three forms.

Segmented (every step, where the CPU kernels run): the rows as indices grouped by slot, each slot's
a segment, for the kernel that multiplies each slot's rows by its A and B alone
(engine/model/kernels/lora_bgmv.cpp: Punica's BGMV, a row's own slot only, each slot's weights read
once for all its rows). Over one adapter's long prompt torch's blocked products are faster per
product, but a step of several adapters' prompts paid more in the grouped form's small products,
gathers and scatters than it saved (docs/benchmarks.md, lora).

Grouped (elsewhere, a step of more than MASKED_ROWS rows: prompt chunks): rows are grouped by slot, so each
adapter's low-rank products run once over all its rows (Punica's segmented products, SGMV, over
torch's matrix products), never once per request. A request's rows are contiguous in the packed
batch; a slot's rows are a slice per run where every run is long (RUN_ROWS), else an index tensor.

Masked (elsewhere, a step of at most MASKED_ROWS rows: a decode batch): every row goes through the rank rows
of all the slots from the first to the last the step uses, in two matrix products per module, and
a mask keeps each row's own slot's part of the first. A decode batch's requests take turns over the
adapters, so grouping them is a gather and a scatter per adapter and module for a few rows each,
and on a CPU those small ops, not the arithmetic, took most of the step (docs/benchmarks.md, lora).
Its extra arithmetic grows with the rows times the slots spanned, hence the bound.

Slot None is the base model: no LoRA term (no group, a zero mask row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Where the kernel does not run, steps of up to this many rows take the masked form (a decode
# batch); larger ones are grouped.
MASKED_ROWS = 256
# A grouped slot whose runs all have at least this many rows (prompt chunks) takes each run as a
# slice: a few more products, but no gather and scatter (index_add_), which on a CPU cost more.
RUN_ROWS = 16


@dataclass(frozen=True)
class SlotRows:
    """The rows of one adapter slot: a slice of the batch when they are one run, else indices."""

    slot: int
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class LoraBatch:
    """A step's rows grouped by adapter slot (the base model's rows in no group); in the masked
    form, `mask` [rows, slots spanned x width]: 1 where a row meets its own slot's rank values of
    the slots `span`, 0 elsewhere (and on the base's rows); in the segmented form, `order` (int64:
    the rows of a slot, slot after slot) and `segments` (int64 [slots used, 3]: the slot and its
    rows' begin and end in `order`)."""

    groups: tuple[SlotRows, ...]
    mask: torch.Tensor | None = None
    span: slice = field(default_factory=lambda: slice(0, 0))
    order: torch.Tensor | None = None
    segments: torch.Tensor | None = None

    @staticmethod
    def of(row_slots: Sequence[tuple[int | None, int]], width: int, dtype: torch.dtype,
           kernel: bool = False, device: torch.device | str = "cpu") -> LoraBatch:
        """From each sequence's (slot or None, rows) in batch order, for slots of `width` rank values
        each holding weights in `dtype` on `device`; `kernel`: whether the CPU kernel serves them."""
        rows = sum(count for _, count in row_slots)
        used = [slot for slot, count in row_slots if slot is not None and count]
        if not used:
            return NO_LORA
        if kernel:
            by_slot: dict[int, list[int]] = {}
            start = 0
            for slot, count in row_slots:
                if slot is not None and count:
                    by_slot.setdefault(slot, []).extend(range(start, start + count))
                start += count
            order, segments = [], []
            for slot, indices in by_slot.items():
                segments.append((slot, len(order), len(order) + len(indices)))
                order.extend(indices)
            return LoraBatch((), order=torch.tensor(order), segments=torch.tensor(segments))
        if rows <= MASKED_ROWS:
            first, last = min(used), max(used)
            mask = torch.zeros(rows, (last - first + 1) * width, dtype=dtype, device=device)
            start = 0
            for slot, count in row_slots:
                if slot is not None:
                    mask[start:start + count, (slot - first) * width:(slot - first + 1) * width] = 1
                start += count
            return LoraBatch((), mask, slice(first, last + 1))
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, count in row_slots:
            if slot is not None and count:
                spans = runs.setdefault(slot, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + count)
                else:
                    spans.append((start, start + count))
            start += count
        groups = []
        for slot, spans in runs.items():
            if len(spans) == 1 or all(b - a >= RUN_ROWS for a, b in spans):
                groups.extend(SlotRows(slot, slice(a, b)) for a, b in spans)
            else:
                groups.append(SlotRows(slot, torch.cat([torch.arange(a, b, device=device) for a, b in spans])))
        return LoraBatch(tuple(groups))

    def __bool__(self) -> bool:
        return bool(self.groups) or self.mask is not None or self.order is not None


NO_LORA = LoraBatch(())
