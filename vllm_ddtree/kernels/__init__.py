"""The DDTree step's Triton kernels, one file per op, each with its host wrapper.

Every kernel has a torch twin in ``vllm_ddtree.ops`` with the same outputs."""
