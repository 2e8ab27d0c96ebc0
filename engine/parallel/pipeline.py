"""One step of a pipeline-parallel engine across its stage processes, and its KV pages' way through
rank 0 (engine.parallel.pipeline_layout says which layers each stage holds).

Every stage gets the step's plan (engine.parallel.step_plan, broadcast as for tensor parallelism)
and cuts it into the same micro-batches. Stage 0 (rank 0, the engine) embeds and runs its layers
over each micro-batch, sending each one's hidden states on as soon as it has them; stage s receives
micro-batch i from stage s - 1, runs its layers and sends it on; the last stage computes the sampled
rows' logits and sends them to rank 0, which samples. Point-to-point sends on the engine's group
(gloo on CPU, NCCL on GPUs), tagged by micro-batch, so a stage's work on micro-batch i + 1 overlaps
the next stage's on micro-batch i.

KV pages leave and enter the engine through rank 0, of every layer, as a one-process engine's do, so
prefill and decode pools of different pipeline layouts pair: for an exported request each stage sends
rank 0 its layers' pages once its micro-batches are done (rank 0 hands them on layer by layer, its
own first), and a page of a layer another stage holds goes from rank 0 to that stage on import. A
layer's pages leave after the stage's whole step, not as soon as the layer wrote them: with
micro-batches a layer is complete only when the last micro-batch has passed it.

With tensor parallelism every stage is that many ranks (world rank = stage x TP + tensor rank), its
collectives within the stage's own group; hidden states go from each rank to the next stage's rank of
the same tensor rank (they are whole after a stage's all-reduces), and pages join within a stage
(engine.parallel.kv_heads) before its first rank sends them on, or split there when they arrive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from engine.attention.metadata import AttentionMetadata
from engine.engine_model import EngineModel
from engine.model.llama import LlamaForCausalLM
from engine.parallel.kv_heads import RankKVHeads
from engine.parallel.pipeline_layout import MicroBatch, PipelineLayout, micro_batches
from engine.parallel.step_plan import PagesPlan, StepPlan

# Point-to-point tags: what a message is, plus the micro-batch or layer it belongs to.
_HIDDEN, _LOGITS, _PAGES_OUT, _PAGES_IN = 1 << 20, 2 << 20, 3 << 20, 4 << 20
Caches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class _Sends:
    """Sends in flight (and the tensors they read, alive until they complete)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, to: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self._pending.append((self.group.send([tensor], to, tag), tensor))

    def wait(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def _receive(group: dist.ProcessGroup, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
             source: int, tag: int) -> torch.Tensor:
    tensor = torch.empty(*shape, dtype=dtype, device=device)
    group.recv([tensor], source, tag).wait()
    return tensor


def _adapters_of(model: LlamaForCausalLM, batch: MicroBatch,
                 lora_slots: list[int | None]) -> contextlib.AbstractContextManager[None]:
    """The micro-batch's rows by adapter slot (its sequences' slots of the step's) for the forward pass."""
    return model.lora_step.running(lora_slots[batch.sequences.start:batch.sequences.stop], batch.meta.query_lens_list)


def _whole_page(loaded: EngineModel) -> tuple[tuple[int, ...], torch.dtype]:
    """One page of all the model's KV heads in its KV format (a tensor-parallel rank holds some)."""
    whole, kv = loaded.config, loaded.kv_format
    return kv.page_shape(loaded.cache.block_size, whole.num_kv_heads, whole.head_dim), kv.storage_dtype


class PipelineStages:
    """Rank 0's side: its stage of each step, the logits from the last, and the pages of the layers
    other stages hold."""

    def __init__(self, loaded: EngineModel, layout: PipelineLayout, tensor_size: int, group: dist.ProcessGroup,
                 announce: Callable[[PagesPlan], None]) -> None:
        """`loaded`: rank 0's model and cache; `tensor_size`: each stage's tensor-parallel ranks;
        `group`: every rank's; `announce` tells every rank what comes (engine.parallel.group's
        broadcast of plans)."""
        self.model = loaded.model
        self.whole = loaded.config
        self.layout = layout
        self.tensor_size = tensor_size
        self.group = group
        self._page = _whole_page(loaded)
        self._announce = announce
        self.local_layers = layout.layers(self.whole, 0)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sample_rows: list[int],
             kv_caches: Caches, on_layer_done: Callable[[int], None] | None,
             lora_slots: list[int | None]) -> torch.Tensor | None:
        """Run stage 0 of a step every rank has the plan of (`lora_slots`: each sequence's adapter slot,
        none without adapters); the sampled rows' logits [rows, vocab] (None where no row is sampled)."""
        sends = _Sends(self.group)
        batches = micro_batches(meta, sample_rows, self.layout.size)
        for index, batch in enumerate(batches):
            rows = slice(batch.rows.start, batch.rows.stop)
            with _adapters_of(self.model, batch, lora_slots):
                out = self.model(input_ids[rows], positions[rows], kv_caches, batch.meta)
            sends.send(out, self.tensor_size, _HIDDEN + index)
        if on_layer_done is not None:  # every layer's pages, in order: this stage's, then the others'
            for layer in range(self.whole.num_layers):
                on_layer_done(layer)
        last = (self.layout.size - 1) * self.tensor_size
        logits = [_receive(self.group, (len(batch.sample_rows), self.whole.vocab_size), torch.float32,
                           input_ids.device, last, _LOGITS + index)
                  for index, batch in enumerate(batches) if batch.sample_rows]
        sends.wait()
        return torch.cat(logits) if logits else None

    def receive_pages(self, layer: int, blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages of `blocks` exported blocks of layer `layer`, which its stage sends after the step."""
        shape, dtype = self._page
        source = self.layout.stage_of(self.whole, layer) * self.tensor_size
        pages = _receive(self.group, (2, blocks, *shape), dtype, device, source, _PAGES_OUT + layer)
        return pages[0], pages[1]

    def send_pages(self, plan: PagesPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hand received pages of a layer another stage holds to it, every rank told first."""
        self._announce(plan)
        sends = _Sends(self.group)
        sends.send(torch.stack([k, v]), self.layout.stage_of(self.whole, plan.layer) * self.tensor_size,
                   _PAGES_IN + plan.layer)
        sends.wait()


class StageRank:
    """A rank of a pipeline-parallel engine other than rank 0: its stage's part of every step, and of
    every import of pages. `heads` joins and splits pages within the stage (None at TP 1)."""

    def __init__(self, loaded: EngineModel, layout: PipelineLayout, tensor_size: int, tensor_rank: int,
                 group: dist.ProcessGroup, heads: RankKVHeads | None) -> None:
        self.model = loaded.model
        self.whole = loaded.config
        self.layout = layout
        self.tensor_size = tensor_size
        self.tensor_rank = tensor_rank
        self.group = group
        self.heads = heads
        self.cache = loaded.cache
        self._page = _whole_page(loaded)
        self.held = layout.layers(self.whole)

    def _rank(self, stage: int) -> int:
        """The world rank of stage `stage`'s rank of this tensor rank."""
        return stage * self.tensor_size + self.tensor_rank

    def step(self, plan: StepPlan) -> None:
        """This rank's part of a step: each micro-batch from the stage before (stage 0: from the
        tokens), through this stage's layers, on to the next (the last stage's first rank: the
        sampled rows' logits to rank 0); then an exported request's pages of this stage's layers."""
        stage, last = self.layout.stage, self.layout.size - 1
        device, dtype = self.model.norm.device, self.model.norm.dtype
        sends = _Sends(self.group)
        for index, batch in enumerate(micro_batches(plan.meta, plan.sample_rows, self.layout.size)):
            rows = slice(batch.rows.start, batch.rows.stop)
            inputs = plan.input_ids[rows] if stage == 0 else _receive(
                self.group, (len(batch.rows), self.whole.hidden_size), dtype, device, self._rank(stage - 1),
                _HIDDEN + index)
            with _adapters_of(self.model, batch, plan.lora_slots):
                out = self.model(inputs, plan.positions[rows], self.cache.kv_caches, batch.meta)
            if stage < last:
                sends.send(out, self._rank(stage + 1), _HIDDEN + index)
            elif batch.sample_rows:  # the logits join across the stage's ranks; its first sends them
                logits = self.model.compute_logits(out[torch.tensor(batch.sample_rows, device=device)])
                if self.tensor_rank == 0:
                    sends.send(logits, 0, _LOGITS + index)
        if plan.export_blocks:
            for local, layer in enumerate(self.held):
                k, v = self.cache.gather_blocks(local, plan.export_blocks)
                if self.heads is not None and self.tensor_rank > 0:
                    self.heads.send(k, v)  # to the stage's first rank (stage 0: rank 0's on_layer_done)
                    continue
                if self.heads is not None:
                    k, v = self.heads.gather(k, v)
                sends.send(torch.stack([k, v]), 0, _PAGES_OUT + layer)
        sends.wait()

    def import_pages(self, plan: PagesPlan) -> None:
        """Take this rank's part of pages rank 0 received for a layer of this stage (else nothing)."""
        if plan.layer not in self.held:
            return
        k_cache = self.cache.kv_caches[0][0]
        blocks = len(plan.block_ids)
        if self.tensor_rank == 0 and self.layout.stage > 0:  # from rank 0, pages of all the heads
            shape, dtype = self._page
            pages = _receive(self.group, (2, blocks, *shape), dtype, k_cache.device, 0, _PAGES_IN + plan.layer)
            k, v = (pages[0], pages[1]) if self.heads is None else self.heads.scatter(pages[0], pages[1])
        else:  # the stage's first rank splits them (stage 0's: rank 0, engine.kv_connector.worker_side)
            assert self.heads is not None
            k, v = self.heads.receive(k_cache.shape[1:], blocks, k_cache.dtype, k_cache.device)
        self.cache.scatter_blocks(plan.layer - self.held.start, plan.block_ids, k, v)
