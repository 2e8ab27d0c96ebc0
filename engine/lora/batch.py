"""Which rows of a step's packed batch go through which adapter slot: computed once per step by
the runner, read by every LoRA product of every layer.

Rows are grouped by slot, so each adapter's low-rank products run once over all its rows
(Punica's segmented products, SGMV, over torch's matrix products), never once per request. A
request's rows are contiguous in the packed batch; a slot whose rows form one run is a slice,
otherwise an index tensor. Slot None is the base model: no LoRA term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotRows:
    """The rows of one adapter slot: a slice of the batch when they are one run, else indices."""

    slot: int
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class LoraBatch:
    """A step's rows grouped by adapter slot (the base model's rows in no group)."""

    groups: tuple[SlotRows, ...]

    @staticmethod
    def of(row_slots: Sequence[tuple[int | None, int]]) -> LoraBatch:
        """From each sequence's (slot or None, rows) in batch order."""
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
            if len(spans) == 1:
                groups.append(SlotRows(slot, slice(*spans[0])))
            else:
                groups.append(SlotRows(slot, torch.cat([torch.arange(a, b) for a, b in spans])))
        return LoraBatch(tuple(groups))

    def __bool__(self) -> bool:
        return bool(self.groups)


NO_LORA = LoraBatch(())
