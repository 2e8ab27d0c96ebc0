"""What rank 0 of a tensor-parallel engine has the other ranks do, as one int64 tensor after a fixed
header (a broadcast, never pickle): a STEP (the token ids, positions and attention metadata of the
packed batch, the rows whose logits are computed and the blocks whose pages leave the engine after
each layer), an IMPORT of one layer's pages outside a step (engine.parallel.kv_heads), a SEQUENCE
(a prompt split across prefill context-parallel ranks: its tokens and the slices' bounds,
engine.parallel.context_parallel), or STOP, which ends the followers' loop.

A STEP of an engine with LoRA adapters also carries each sequence's adapter slot and the adapters
to copy into slots before it. An adapter goes whole, in float32 (lossless from any dtype a model
runs in), and each rank keeps its part (engine.parallel.adapter_shard). Why broadcast it rather
than have each rank read the adapter's files: rank 0 has read and checked it already (a rank's
read could fail or find other files after an update, and the ranks would compute different
adapters), a rank on another host need not see the path, and an adapter loads once per slot, not
per step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.attention.metadata import AttentionMetadata
from engine.lora.adapter import MODULES, LoraWeights

STEP, STOP, IMPORT, SEQUENCE = 1, 2, 4, 8
# STEP: kind, tokens, sequences, block-table width, sampled rows, exported blocks, sequences' adapter
# slots (0 without adapters), adapters loaded, their projections
_HEADER = 9
_MODULES = tuple(MODULES)  # a projection's number on the wire


@dataclass(frozen=True)
class AdapterLoad:
    """An adapter copied into a slot before a step: its rank and whole weights by (layer, PEFT module)."""

    slot: int
    rank: int
    weights: Mapping[tuple[int, str], LoraWeights]


@dataclass(frozen=True)
class StepPlan:
    """What every rank needs to run one forward pass."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # the rows whose logits are computed (and gathered)
    export_blocks: list[int]  # the blocks whose pages rank 0 gathers after each layer
    lora_slots: list[int | None] = field(default_factory=list)  # each sequence's adapter slot (None: the base)
    adapter_loads: list[AdapterLoad] = field(default_factory=list)


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
        _broadcast(group, torch.tensor([STOP] + [0] * (_HEADER - 1), dtype=torch.int64))
        return
    if isinstance(plan, SequencePlan):
        _broadcast(group, torch.tensor([SEQUENCE, plan.input_ids.numel(), len(plan.bounds)] + [0] * (_HEADER - 3),
                                       dtype=torch.int64))
        _broadcast(group, torch.cat([plan.input_ids.cpu(), torch.tensor(plan.bounds, dtype=torch.int64)]))
        return
    if isinstance(plan, PagesPlan):
        _broadcast(group, torch.tensor([IMPORT, plan.layer, len(plan.block_ids)] + [0] * (_HEADER - 3),
                                       dtype=torch.int64))
        _broadcast(group, torch.tensor(plan.block_ids, dtype=torch.int64))
        return
    meta = plan.meta
    tokens, sequences = plan.input_ids.numel(), len(meta.seq_lens_list)
    loads = plan.adapter_loads
    # Per load: slot, rank, projections; per projection: layer, module, out, in.
    index = [value for load in loads for value in (load.slot, load.rank, len(load.weights))]
    index += [value for load in loads for (layer, module), lora in load.weights.items()
              for value in (layer, _MODULES.index(module), lora.b.shape[0], lora.a.shape[1])]
    header = torch.tensor([STEP, tokens, sequences, meta.block_tables.shape[1], len(plan.sample_rows),
                           len(plan.export_blocks), len(plan.lora_slots), len(loads),
                           sum(len(load.weights) for load in loads)], dtype=torch.int64)
    body = torch.cat([plan.input_ids.cpu(), plan.positions.cpu(), meta.slot_mapping.cpu(),
                      meta.query_start_loc.cpu().long(), meta.seq_lens.cpu().long(),
                      meta.block_tables.cpu().long().reshape(-1), torch.tensor(plan.sample_rows, dtype=torch.int64),
                      torch.tensor(plan.export_blocks, dtype=torch.int64),
                      torch.tensor([-1 if slot is None else slot for slot in plan.lora_slots], dtype=torch.int64),
                      torch.tensor(index, dtype=torch.int64)])
    _broadcast(group, header)
    _broadcast(group, body)
    if loads:
        _broadcast(group, torch.cat([tensor.cpu().float().reshape(-1) for load in loads
                                     for lora in load.weights.values() for tensor in (lora.a, lora.b)]))


def receive_plan(group: dist.ProcessGroup, device: torch.device) -> StepPlan | PagesPlan | SequencePlan | None:
    """The other ranks: the next plan rank 0 sends, its tensors on `device`; None when told to stop."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    _broadcast(group, header)
    kind, tokens, sequences, width, sampled, exported, slotted, loaded, projections = header.tolist()
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
    sizes = [tokens, tokens, tokens, sequences + 1, sequences, sequences * width, sampled, exported, slotted,
             3 * loaded + 4 * projections]
    body = torch.empty(sum(sizes), dtype=torch.int64)
    _broadcast(group, body)
    input_ids, positions, slots, query_start, seq_lens, tables, rows, export_blocks, lora_slots, index = (
        body.split(sizes))
    query_lens = (query_start[1:] - query_start[:-1]).tolist()
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=query_start.to(device, torch.int32),
        seq_lens=seq_lens.to(device, torch.int32),
        block_tables=tables.reshape(sequences, width).to(device, torch.int32),
        query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(seq_lens.tolist()),
    )
    return StepPlan(input_ids.to(device), positions.to(device), meta, rows.tolist(), export_blocks.tolist(),
                    [None if slot < 0 else slot for slot in lora_slots.tolist()],
                    _receive_loads(group, index, loaded))


def _receive_loads(group: dist.ProcessGroup, index: torch.Tensor, loaded: int) -> list[AdapterLoad]:
    """The adapters rank 0 sends after a STEP's body whose `index` (of `loaded` adapters) says their shapes."""
    if not loaded:
        return []
    shapes = iter(index[3 * loaded:].view(-1, 4).tolist())
    described = [(slot, rank, [next(shapes) for _ in range(count)])
                 for slot, rank, count in index[:3 * loaded].view(-1, 3).tolist()]
    payload = torch.empty(sum(rank * (inp + out) for _, rank, projections in described
                              for _, _, out, inp in projections), dtype=torch.float32)
    _broadcast(group, payload)
    loads, start = [], 0
    for slot, rank, projections in described:
        weights = {}
        for layer, module, out, inp in projections:
            a = payload[start:start + rank * inp].view(rank, inp)
            b = payload[start + rank * inp:start + rank * (inp + out)].view(out, rank)
            weights[(layer, _MODULES[module])] = LoraWeights(a, b)
            start += rank * (inp + out)
        loads.append(AdapterLoad(slot, rank, weights))
    return loads
