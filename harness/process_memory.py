"""Resident memory of processes, read from /proc: one reading, or samples taken on a thread while
a load runs (for the overload test's bound and the soak's flat-memory verdict)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping


def rss_bytes(pid: int) -> int:
    """The process's resident set size now (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no VmRSS line")


class RssSampler:
    """Samples the RSS of named processes every `interval_s` on a daemon thread, from `start()` to
    `stop()`: `samples` is a list of (seconds since start, {name: bytes})."""

    def __init__(self, pids: Mapping[str, int], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RssSampler:
        """Take a first sample now and keep sampling."""
        self._start = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, dict[str, int]]]:
        """Stop sampling after one last sample; the samples."""
        self._stopped.set()
        self._thread.join()
        self._sample()
        return self.samples

    def peak(self, name: str) -> int:
        """The highest RSS sampled for `name`."""
        return max(sample[name] for _, sample in self.samples)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        self.samples.append((time.monotonic() - self._start, {name: rss_bytes(pid) for name, pid in self.pids.items()}))
