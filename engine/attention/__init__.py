"""Paged attention: a torch reference (the CPU serving path) and Triton kernels."""
