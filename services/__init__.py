"""Tandem's processes: the prefill and decode workers, the gateway, and the `tandem` CLI."""
