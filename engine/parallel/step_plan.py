"""A step's inputs as rank 0 of a tensor-parallel engine sends them to the other ranks: the token
ids, positions and attention metadata of the packed batch and the rows whose logits are computed,
as one int64 tensor after a fixed header (a broadcast, never pickle). A header of kind STOP ends
the followers' loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.attention.metadata import AttentionMetadata

STEP, STOP = 1, 2
_HEADER = 5  # kind, tokens, sequences, block-table width, sampled rows


@dataclass(frozen=True)
class StepPlan:
    """What every rank needs to run one forward pass."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # the rows whose logits are computed (and gathered)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send_plan(group: dist.ProcessGroup, plan: StepPlan | None) -> None:
    """Rank 0: send `plan` to the other ranks (None: tell them to stop)."""
    if plan is None:
        _broadcast(group, torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64))
        return
    meta = plan.meta
    tokens, sequences = plan.input_ids.numel(), len(meta.seq_lens_list)
    header = torch.tensor([STEP, tokens, sequences, meta.block_tables.shape[1], len(plan.sample_rows)],
                          dtype=torch.int64)
    body = torch.cat([plan.input_ids.cpu(), plan.positions.cpu(), meta.slot_mapping.cpu(),
                      meta.query_start_loc.cpu().long(), meta.seq_lens.cpu().long(),
                      meta.block_tables.cpu().long().reshape(-1), torch.tensor(plan.sample_rows, dtype=torch.int64)])
    _broadcast(group, header)
    _broadcast(group, body)


def receive_plan(group: dist.ProcessGroup, device: torch.device) -> StepPlan | None:
    """The other ranks: the next plan rank 0 sends, its tensors on `device`; None when told to stop."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    _broadcast(group, header)
    kind, tokens, sequences, width, sampled = header.tolist()
    if kind == STOP:
        return None
    body = torch.empty(3 * tokens + 2 * sequences + 1 + sequences * width + sampled, dtype=torch.int64)
    _broadcast(group, body)
    parts = body.split([tokens, tokens, tokens, sequences + 1, sequences, sequences * width, sampled])
    input_ids, positions, slots, query_start, seq_lens, tables, rows = parts
    query_lens = (query_start[1:] - query_start[:-1]).tolist()
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=query_start.to(device, torch.int32),
        seq_lens=seq_lens.to(device, torch.int32),
        block_tables=tables.reshape(sequences, width).to(device, torch.int32),
        query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(seq_lens.tolist()),
    )
    return StepPlan(input_ids.to(device), positions.to(device), meta, rows.tolist())
