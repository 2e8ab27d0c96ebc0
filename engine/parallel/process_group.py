"""Joining the process group of one tensor-parallel engine, which rank 0 (engine.parallel.group)
and every follower (engine.parallel.follower) do alike: gloo on CPU; NCCL on CUDA, rank r on the
r-th GPU after the engine's own; through a store on a loopback port.

Between steps the other ranks wait in a broadcast for the next step plan, which may take any time,
so the group never times out an idle wait.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import EngineConfig

# Between steps a follower waits for the next plan for as long as the worker is idle.
IDLE_TIMEOUT = timedelta(days=365)
JOIN_TIMEOUT = timedelta(minutes=10)  # the followers' start (imports) before they join the store


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device rank `rank` computes on: the CPU, or the rank-th GPU from `config.device`'s."""
    device = torch.device(config.device)
    return device if device.type == "cpu" else torch.device("cuda", (device.index or 0) + rank)


def join_group(port: int, rank: int, size: int, device: torch.device,
               store: dist.Store | None = None, prefix: str = "") -> dist.ProcessGroup:
    """Rank `rank`'s side of the group whose store listens on loopback `port` (rank 0 passes the
    store it hosts); with `prefix`, a group of some of the engine's processes (a pipeline stage's
    tensor-parallel ranks) meeting under that prefix of the same store."""
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=JOIN_TIMEOUT)
    if prefix:
        store = dist.PrefixStore(prefix, store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = IDLE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = IDLE_TIMEOUT
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, gloo)


def stage_prefix(stage: int) -> str:
    """The store prefix under which pipeline stage `stage`'s tensor-parallel ranks form their group."""
    return f"stage{stage}/"
