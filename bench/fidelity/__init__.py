"""The fidelity suite's parts (python -m bench fidelity): the formats it compares and their report."""
