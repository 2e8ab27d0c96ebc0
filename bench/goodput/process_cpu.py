"""CPU time spent by a deployment's processes over a rate, by role: where the cores went.

A configuration's processes and their descendants (a mesh's workers and gateway, vLLM's engine
core) are read through psutil and named by their role: the Tandem subcommand (`gateway`,
`prefill`, `decode`, `worker colocated`...) or `vllm`. The gateway's seconds over the output tokens of
a rate are its CPU cost per token, which the goodput summary reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import psutil

_SERVERS = ("gateway", "worker", "prefill", "decode", "mesh")


def role_of(cmdline: list[str]) -> str:
    """The role a server process plays, from its command line."""
    if "services.cli" in cmdline:
        args = cmdline[cmdline.index("services.cli") + 1:]
        command = next((a for a in args if a in _SERVERS), "tandem")
        if command == "worker" and "--role" in args:
            return f"worker {args[args.index('--role') + 1]}"
        return command
    # vLLM's engine core retitles itself "VLLM::EngineCore".
    return "vllm" if any("vllm" in part.lower() for part in cmdline) else "other"


def cpu_seconds(pids: Iterable[int]) -> dict[str, float]:
    """User plus system CPU seconds so far of the processes and their descendants, summed by role;
    a process that ended in the meantime is left out."""
    totals: dict[str, float] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    role = role_of(process.cmdline())
                    totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each role spent between two readings."""
    return {role: round(after[role] - before.get(role, 0.0), 3) for role in after}
