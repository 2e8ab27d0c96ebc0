"""Tandem's benchmarks: `python -m bench SUITE [flags]` runs one suite (`python -m bench --help` lists them).

`bench.suites` holds one module per suite, `bench.common` what several suites share, and
`bench.fidelity`, `bench.goodput`, `bench.llamacpp`, `bench.planner`, `bench.throughput` and `bench.vllm`
the parts of one suite each. The server processes, meshes and load clients come from harness/ (the tests
use them too). Nothing here is imported by the services or by harness/, and bench is not part of the wheel.
"""
