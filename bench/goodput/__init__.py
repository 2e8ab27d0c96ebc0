"""The goodput suite's parts: the configurations it starts, vLLM's own client, the gateway log's
routing figures, and the report."""
