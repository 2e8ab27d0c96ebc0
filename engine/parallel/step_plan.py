"""What rank 0 of a tensor-parallel engine has the other ranks do, as one int64 tensor after a fixed
header (a broadcast, never pickle): a STEP (the token ids, positions and attention metadata of the
packed batch, the rows whose logits are computed and the blocks whose pages leave the engine after
each layer), an IMPORT of one layer's pages outside a step (engine.parallel.kv_heads), a SEQUENCE
(a prompt split across prefill context-parallel ranks: its tokens and the slices' bounds,
engine.parallel.context_parallel), or STOP, which ends the followers' loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.attention.metadata import AttentionMetadata

STEP, STOP, IMPORT, SEQUENCE = 1, 2, 4, 8
_HEADER = 6  # STEP: kind, tokens, sequences, block-table width, sampled rows, exported blocks


@dataclass(frozen=True)
class StepPlan:
    """What every rank needs to run one forward pass."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # the rows whose logits are computed (and gathered)
    export_blocks: list[int]  # the blocks whose pages rank 0 gathers after each layer


@dataclass(frozen=True)
class PagesPlan:
    """Scatter one layer's received pages of some blocks from rank 0 to the ranks (each keeps its heads)."""

    layer: int
    block_ids: list[int]


@dataclass(frozen=True)
class SequencePlan:
    """A whole prompt whose prefill the context-parallel ranks split: rank r computes its tokens
    [bounds[r], bounds[r + 1])."""

    input_ids: torch.Tensor  # [T] int64
    bounds: list[int]


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send_plan(group: dist.ProcessGroup, plan: StepPlan | PagesPlan | SequencePlan | None) -> None:
    """Rank 0: send `plan` to the other ranks (None: tell them to stop)."""
    if plan is None:
        _broadcast(group, torch.tensor([STOP, 0, 0, 0, 0, 0], dtype=torch.int64))
        return
    if isinstance(plan, SequencePlan):
        _broadcast(group, torch.tensor([SEQUENCE, plan.input_ids.numel(), len(plan.bounds), 0, 0, 0],
                                       dtype=torch.int64))
        _broadcast(group, torch.cat([plan.input_ids.cpu(), torch.tensor(plan.bounds, dtype=torch.int64)]))
        return
    if isinstance(plan, PagesPlan):
        _broadcast(group, torch.tensor([IMPORT, plan.layer, len(plan.block_ids), 0, 0, 0], dtype=torch.int64))
        _broadcast(group, torch.tensor(plan.block_ids, dtype=torch.int64))
        return
    meta = plan.meta
    tokens, sequences = plan.input_ids.numel(), len(meta.seq_lens_list)
    header = torch.tensor([STEP, tokens, sequences, meta.block_tables.shape[1], len(plan.sample_rows),
                           len(plan.export_blocks)], dtype=torch.int64)
    body = torch.cat([plan.input_ids.cpu(), plan.positions.cpu(), meta.slot_mapping.cpu(),
                      meta.query_start_loc.cpu().long(), meta.seq_lens.cpu().long(),
                      meta.block_tables.cpu().long().reshape(-1), torch.tensor(plan.sample_rows, dtype=torch.int64),
                      torch.tensor(plan.export_blocks, dtype=torch.int64)])
    _broadcast(group, header)
    _broadcast(group, body)


def receive_plan(group: dist.ProcessGroup, device: torch.device) -> StepPlan | PagesPlan | SequencePlan | None:
    """The other ranks: the next plan rank 0 sends, its tensors on `device`; None when told to stop."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    _broadcast(group, header)
    kind, tokens, sequences, width, sampled, exported = header.tolist()
    if kind == STOP:
        return None
    if kind == SEQUENCE:
        body = torch.empty(tokens + sequences, dtype=torch.int64)
        _broadcast(group, body)
        return SequencePlan(body[:tokens].to(device), body[tokens:].tolist())
    if kind == IMPORT:
        layer, blocks = tokens, sequences
        block_ids = torch.empty(blocks, dtype=torch.int64)
        _broadcast(group, block_ids)
        return PagesPlan(layer, block_ids.tolist())
    body = torch.empty(3 * tokens + 2 * sequences + 1 + sequences * width + sampled + exported, dtype=torch.int64)
    _broadcast(group, body)
    parts = body.split([tokens, tokens, tokens, sequences + 1, sequences, sequences * width, sampled, exported])
    input_ids, positions, slots, query_start, seq_lens, tables, rows, export_blocks = parts
    query_lens = (query_start[1:] - query_start[:-1]).tolist()
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=query_start.to(device, torch.int32),
        seq_lens=seq_lens.to(device, torch.int32),
        block_tables=tables.reshape(sequences, width).to(device, torch.int32),
        query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(seq_lens.tolist()),
    )
    return StepPlan(input_ids.to(device), positions.to(device), meta, rows.tolist(), export_blocks.tolist())
