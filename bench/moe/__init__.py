"""The moe suite's parts (bench/suites/moe.py): shapes and checkpoints, the per-expert reference,
and the step, rank and roofline figures."""
