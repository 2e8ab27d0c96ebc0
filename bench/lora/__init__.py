"""The lora suite's parts (bench/suites/lora.py): the cached adapters, the programs that time each
system's setups in a process of their own, and the report."""
