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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from engine.attention.metadata import AttentionMetadata
from engine.config import ModelConfig
from engine.kv_cache.cache_engine import CacheEngine
from engine.model.llama import LlamaForCausalLM
from engine.parallel.pipeline_layout import PipelineLayout, micro_batches
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


class PipelineStages:
    """Rank 0's side: its stage of each step, the logits from the last, and the pages of the layers
    other stages hold."""

    def __init__(self, model: LlamaForCausalLM, whole: ModelConfig, layout: PipelineLayout,
                 group: dist.ProcessGroup, cache: CacheEngine, announce: Callable[[PagesPlan], None]) -> None:
        """`whole`: the whole model's config; `cache`: this stage's KV cache; `announce` tells every
        stage what comes (engine.parallel.group's broadcast of plans)."""
        self.model = model
        self.whole = whole
        self.layout = layout
        self.group = group
        k_cache = cache.kv_caches[0][0]
        self._page = (tuple(k_cache.shape[1:]), k_cache.dtype)
        self._announce = announce
        self.local_layers = layout.layers(whole, 0)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sample_rows: list[int],
             kv_caches: Caches, on_layer_done: Callable[[int], None] | None) -> torch.Tensor | None:
        """Run stage 0 of a step every stage has the plan of; the sampled rows' logits [rows, vocab]
        (None where no row is sampled)."""
        sends = _Sends(self.group)
        batches = micro_batches(meta, sample_rows, self.layout.size)
        for index, batch in enumerate(batches):
            rows = slice(batch.rows.start, batch.rows.stop)
            sends.send(self.model(input_ids[rows], positions[rows], kv_caches, batch.meta), 1, _HIDDEN + index)
        if on_layer_done is not None:  # every layer's pages, in order: this stage's, then the others'
            for layer in range(self.whole.num_layers):
                on_layer_done(layer)
        last = self.layout.size - 1
        logits = [_receive(self.group, (len(batch.sample_rows), self.whole.vocab_size), torch.float32,
                           input_ids.device, last, _LOGITS + index)
                  for index, batch in enumerate(batches) if batch.sample_rows]
        sends.wait()
        return torch.cat(logits) if logits else None

    def receive_pages(self, layer: int, blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages of `blocks` exported blocks of layer `layer`, which its stage sends after the step."""
        shape, dtype = self._page
        pages = _receive(self.group, (2, blocks, *shape), dtype, device, self.layout.stage_of(self.whole, layer),
                         _PAGES_OUT + layer)
        return pages[0], pages[1]

    def send_pages(self, plan: PagesPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hand received pages of a layer another stage holds to it, every stage told first."""
        self._announce(plan)
        sends = _Sends(self.group)
        sends.send(torch.stack([k, v]), self.layout.stage_of(self.whole, plan.layer), _PAGES_IN + plan.layer)
        sends.wait()


def follow_step(model: LlamaForCausalLM, whole: ModelConfig, layout: PipelineLayout, group: dist.ProcessGroup,
                plan: StepPlan, cache: CacheEngine) -> None:
    """Stage `layout.stage` (> 0) of a step: each micro-batch from the stage before, through this
    stage's layers, on to the next (the last: the sampled rows' logits to rank 0); then, for an
    exported request, this stage's layers' pages to rank 0."""
    stage, last = layout.stage, layout.size - 1
    device, dtype = model.norm.device, model.norm.dtype
    sends = _Sends(group)
    for index, batch in enumerate(micro_batches(plan.meta, plan.sample_rows, layout.size)):
        hidden = _receive(group, (len(batch.rows), whole.hidden_size), dtype, device, stage - 1, _HIDDEN + index)
        rows = slice(batch.rows.start, batch.rows.stop)
        out = model(hidden, plan.positions[rows], cache.kv_caches, batch.meta)
        if stage < last:
            sends.send(out, stage + 1, _HIDDEN + index)
        elif batch.sample_rows:
            sends.send(model.compute_logits(out[torch.tensor(batch.sample_rows, device=device)]), 0, _LOGITS + index)
    if plan.export_blocks:
        for local, layer in enumerate(layout.layers(whole)):
            sends.send(torch.stack(cache.gather_blocks(local, plan.export_blocks)), 0, _PAGES_OUT + layer)
    sends.wait()


def follow_pages(whole: ModelConfig, layout: PipelineLayout, group: dist.ProcessGroup, plan: PagesPlan,
                 cache: CacheEngine) -> None:
    """Take the pages rank 0 received for a layer this stage holds (other stages: nothing to do)."""
    held = layout.layers(whole)
    if plan.layer not in held:
        return
    k_cache = cache.kv_caches[0][0]
    pages = _receive(group, (2, len(plan.block_ids), *k_cache.shape[1:]), k_cache.dtype, k_cache.device, 0,
                     _PAGES_IN + plan.layer)
    cache.scatter_blocks(plan.layer - held.start, plan.block_ids, pages[0], pages[1])
