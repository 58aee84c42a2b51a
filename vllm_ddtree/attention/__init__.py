"""DDTree's attention backends: subclasses of vLLM's that attend tree rows under their
ancestor masks (``cpu.py``: CPU_ATTN; ``cpu_mla.py``: CPU_MLA; ``cuda.py``: FLASH_ATTN
and TRITON_ATTN; ``cuda_mla.py``: TRITON_MLA; ``cuda_flash_mla.py``: FLASH_ATTN_MLA),
the metadata hook they share (``common.py``) and the step's published
tree (``state.py``).
"""

from __future__ import annotations

import torch

__all__ = ["register_backends"]


def register_backends(device) -> None:
    """Point vLLM's platform attention backend at its DDTree subclass.

    Called by a DDTree model runner before the model is built, so only
    engines that run DDTree see the subclass. Uses vLLM's own extension
    point, ``register_backend``, which overrides a backend's class path.
    """
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    overrides = {
        "cpu": {
            AttentionBackendEnum.CPU_ATTN: "cpu.DDTreeCPUAttentionBackend",
            AttentionBackendEnum.CPU_MLA: "cpu_mla.DDTreeCPUMLABackend",
        },
        "cuda": {
            AttentionBackendEnum.FLASH_ATTN: "cuda.DDTreeFlashAttentionBackend",
            AttentionBackendEnum.TRITON_ATTN: "cuda.DDTreeTritonAttentionBackend",
            AttentionBackendEnum.TRITON_MLA: "cuda_mla.DDTreeTritonMLABackend",
            AttentionBackendEnum.FLASH_ATTN_MLA: "cuda_flash_mla.DDTreeFlashAttnMLABackend",
        },
    }.get(torch.device(device).type)
    if overrides is None:
        raise NotImplementedError(
            f"DDTree has tree attention for CPU and CUDA devices, not {device!r}."
        )
    for backend, path in overrides.items():
        register_backend(backend, f"vllm_ddtree.attention.{path}")
    # A backend resolved before this point would stay cached as the parent.
    selector._cached_get_attn_backend.cache_clear()
