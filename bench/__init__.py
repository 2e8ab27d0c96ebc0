"""Tandem's benchmarks: `python -m bench SUITE [flags]` runs one suite (`python -m bench --help` lists them).

`bench.suites` holds one module per suite, `bench.harness` what several suites and the integration
tests share (the server processes, the load, the clients, the metrics, where results go), and
`bench.goodput`, `bench.planner`, `bench.throughput` and `bench.vllm` the parts of one suite each.
Nothing here is imported by the services: they run without it.
"""
