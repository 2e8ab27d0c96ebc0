"""How the reliability benchmarks (cancel_storm, overload, soak) end: the verdict printed, the results
written to bench/results/<name>.json (not in smoke mode, whose figures are not results) and the exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def finish(name: str, results: dict, problems: list[str], passed: str, smoke: bool) -> int:
    """Print PROBLEMS or PASS (`passed` says what passing means), write the results with the command
    line, the problems and the settings, and return 1 if there was a problem, else 0."""
    print("\n".join(["PROBLEMS:", *problems]) if problems else f"PASS: {passed}")
    if smoke:
        print("smoke mode: results not written")
    else:
        path = RESULTS_DIR / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": " ".join(["python", *sys.argv]), **results, "problems": problems}
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path.relative_to(RESULTS_DIR.parents[1])}")
    return 1 if problems else 0
