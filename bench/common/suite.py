"""How every suite starts and ends: its flag parser, the command line that reproduces a run, and its
results, written as JSON to the ignored results folder (a smoke run's to results/smoke/, so that it
never replaces a real run's)."""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common.paths import RESULTS_DIR
from harness.paths import REPO


def suite_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The flag parser of the suite `module` (its `__name__`), described by the module's docstring."""
    name = module.rsplit(".", 1)[-1]
    return argparse.ArgumentParser(prog=f"python -m bench {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that runs the suite `module` with `argv` again."""
    return shlex.join(["python", "-m", "bench", module.rsplit(".", 1)[-1], *argv])


def results_path(module: str, smoke: bool = False, suffix: str = ".json") -> Path:
    """Where the suite `module` writes by default: bench/results/<suite><suffix>, or under
    bench/results/smoke/ for a smoke run."""
    return (RESULTS_DIR / "smoke" if smoke else RESULTS_DIR) / (module.rsplit(".", 1)[-1] + suffix)


def write_results(path: str | Path, record: dict) -> Path:
    """Write `record` as indented JSON at `path` (folders made as needed) and say so; the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return path


def load_average() -> str:
    """The 1, 5 and 15-minute load averages: figures taken on a shared machine say how shared it was."""
    with open("/proc/loadavg", encoding="utf-8") as file:
        return " ".join(file.read().split()[:3])


def begin_run(threads: int | None) -> tuple[str, dict[str, str]]:
    """Start an in-process suite's run: torch's threads set to `threads` (when given); when it started
    and the load then (the caller adds the load at the end)."""
    if threads:
        import torch  # only the in-process suites need it

        torch.set_num_threads(threads)
    return time.strftime("%Y-%m-%d %H:%M:%S %Z"), {"start": load_average()}
