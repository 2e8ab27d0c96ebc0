"""How the reliability suites (cancel_storm, overload, soak) end: the verdict printed, the results
written with their problems and the command line, and the exit code."""

from __future__ import annotations

from collections.abc import Sequence

from bench.common.suite import command_line, results_path, write_results


def finish(module: str, argv: Sequence[str], results: dict, problems: list[str], passed: str, smoke: bool) -> int:
    """Print PROBLEMS or PASS (`passed` says what passing means), write the results of the suite
    `module` run with `argv` (a smoke run's under results/smoke/: its figures are not results), and
    return 1 if there was a problem, else 0."""
    print("\n".join(["PROBLEMS:", *problems]) if problems else f"PASS: {passed}")
    write_results(results_path(module, smoke), {"command": command_line(module, argv), **results,
                                                "problems": problems})
    return 1 if problems else 0
