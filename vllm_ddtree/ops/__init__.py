"""Torch twins of the DDTree step: each op the CPU path, the test oracle of its
Triton kernel, and the one place that picks the kernel on CUDA."""
