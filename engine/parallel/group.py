"""The processes of one tensor-parallel engine: rank 0 (the engine: scheduler, sampler, the
worker's gRPC face) starts the other ranks as child processes and joins them in one process group
(engine.parallel.process_group), which never times out an idle wait; a rank that dies fails the
others' pending collectives at once (gloo), so rank 0's step raises and the followers' loop ends
instead of hanging. Followers are daemon processes: they die with rank 0's exit.
"""

from __future__ import annotations

import contextlib
import multiprocessing

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.parallel.follower import follow
from engine.parallel.kv_heads import RankKVHeads
from engine.parallel.process_group import JOIN_TIMEOUT, join_group, rank_device, stage_prefix
from engine.parallel.step_plan import PagesPlan, SequencePlan, StepPlan, send_plan


class TensorParallelGroup:
    """Rank 0's view: the group and the follower processes."""

    def __init__(self, config: EngineConfig) -> None:
        """Start ranks 1.. of `config.tensor_parallel_size` (each loads its shard of the model and
        follows rank 0's step plans: engine.parallel.follower) and join them."""
        size = config.world_size
        self._tensor_size = config.tensor_parallel_size
        self._store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.followers = [context.Process(target=follow, args=(config, rank, self._store.port, torch.get_num_threads()),
                                          name=f"tensor-parallel-rank-{rank}", daemon=True)
                          for rank in range(1, size)]
        for process in self.followers:
            process.start()
        self.group = join_group(self._store.port, 0, size, rank_device(config, 0), self._store)
        # The group of the tensor-parallel ranks: all of them, or with pipeline stages the first stage's.
        self.tensor_group = self.group
        if self._tensor_size > 1 and config.pipeline_parallel_size > 1:
            self.tensor_group = join_group(self._store.port, 0, config.tensor_parallel_size, rank_device(config, 0),
                                           self._store, stage_prefix(0))

    def ready(self, model: ModelConfig) -> None:
        """Wait until every rank has loaded its shard of `model`; RuntimeError if one could not."""
        self.group.barrier().wait()
        if self._tensor_size > 1:  # context-parallel ranks keep no pages; stages relay their own
            self.kv_heads = RankKVHeads(model, self._tensor_size, self.tensor_group)

    def send(self, plan: StepPlan | PagesPlan | SequencePlan) -> None:
        """Have every other rank run `plan` (a forward pass, or moving pages) beside this one."""
        send_plan(self.group, plan)

    def lost_rank(self) -> str | None:
        """"rank N exited with code C" for a follower no longer running, else None: the first that
        failed (a code other than 0), since a follower whose peer died stops cleanly in its wake and
        would name a consequence instead of the cause."""
        gone = [(rank, process.exitcode) for rank, process in enumerate(self.followers, start=1)
                if not process.is_alive()]
        if not gone:
            return None
        rank, code = next(((rank, code) for rank, code in gone if code != 0), gone[0])
        return f"tensor-parallel rank {rank} exited with code {code}"

    def close(self, ready: bool = True) -> None:
        """Stop the followers: with a STOP plan once they are `ready` (in their loop), else (a failed
        start) at once."""
        if ready:
            # A follower already gone has ended the others' loops with it: nothing to stop then.
            with contextlib.suppress(RuntimeError):
                send_plan(self.group, None)
        for process in self.followers:
            process.join(timeout=10 if ready else 0)
            if process.is_alive():
                process.kill()
                process.join()
