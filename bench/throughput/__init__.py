"""The engine_throughput suite's parts: the programs that time each system in a process of its own,
the machine's roofline, and the report."""
