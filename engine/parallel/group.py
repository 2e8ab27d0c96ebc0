"""The processes of one tensor-parallel engine: rank 0 (the engine: scheduler, sampler, the
worker's gRPC face) starts the other ranks as child processes and joins them in one process group
(gloo on CPU; NCCL on CUDA, rank r on the r-th GPU after the engine's own) through a store on a loopback port.

Between steps the other ranks wait in a broadcast for the next step plan, which may take any time,
so the group never times out an idle wait; a rank that dies fails the others' pending collectives
at once (gloo), so rank 0's step raises and the followers' loop ends instead of hanging. Followers
are daemon processes: they die with rank 0's exit.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.parallel.kv_heads import RankKVHeads
from engine.parallel.step_plan import PagesPlan, StepPlan, send_plan

# Between steps a follower waits for the next plan for as long as the worker is idle.
IDLE_TIMEOUT = timedelta(days=365)
_JOIN_TIMEOUT = timedelta(minutes=10)  # the followers' start (imports) before they join the store


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device rank `rank` computes on: the CPU, or the rank-th GPU from `config.device`'s."""
    device = torch.device(config.device)
    return device if device.type == "cpu" else torch.device("cuda", (device.index or 0) + rank)


def join_group(port: int, rank: int, size: int, device: torch.device,
               store: dist.Store | None = None) -> dist.ProcessGroup:
    """Rank `rank`'s side of the group whose store listens on loopback `port` (rank 0 passes the
    store it hosts)."""
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=_JOIN_TIMEOUT)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = IDLE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = IDLE_TIMEOUT
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, gloo)


class TensorParallelGroup:
    """Rank 0's view: the group and the follower processes."""

    def __init__(self, config: EngineConfig) -> None:
        """Start ranks 1.. of `config.tensor_parallel_size` (each loads its shard of the model and
        follows rank 0's step plans: engine.parallel.follower) and join them."""
        from engine.parallel.follower import follow  # the follower's module imports this one

        size = config.tensor_parallel_size
        self._store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=_JOIN_TIMEOUT, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.followers = [context.Process(target=follow, args=(config, rank, self._store.port, torch.get_num_threads()),
                                          name=f"tensor-parallel-rank-{rank}", daemon=True)
                          for rank in range(1, size)]
        for process in self.followers:
            process.start()
        self.group = join_group(self._store.port, 0, size, rank_device(config, 0), self._store)

    def ready(self, model: ModelConfig) -> None:
        """Wait until every rank has loaded its shard of `model`; RuntimeError if one could not."""
        self.group.barrier().wait()
        self.kv_heads = RankKVHeads(model, len(self.followers) + 1, self.group)

    def send(self, plan: StepPlan | PagesPlan) -> None:
        """Have every other rank run `plan` (a forward pass, or moving pages) beside this one."""
        send_plan(self.group, plan)

    def lost_rank(self) -> str | None:
        """"rank N exited with code C" for the first follower no longer running, else None."""
        for rank, process in enumerate(self.followers, start=1):
            if not process.is_alive():
                return f"tensor-parallel rank {rank} exited with code {process.exitcode}"
        return None

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
