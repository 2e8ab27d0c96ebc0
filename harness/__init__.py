"""What the tests and the benchmarks both use to run Tandem and drive it: server processes and meshes
of them (on loopback or across hosts in network namespaces), free ports, the leak check, the load
clients (the storm and the burst), an OTLP receiver, greedy decoding across ranks, and the model
files, quantized checkpoints and random LoRA adapters they serve.

Tests and bench/ import it; it imports neither, and the services never import it. It is not part of
the wheel.
"""
