"""Tree attention for DDTree verify rows: plain-torch reference and cache helpers."""

import torch

from vllm_ddtree.ops.attention_reference import (
    tree_attention_reference,
    write_kv_to_cache,
)
from vllm_ddtree.tensors import pack_tree_mask, unpack_tree_mask

__all__ = [
    "pack_tree_mask",
    "tree_attention_reference",
    "unpack_tree_mask",
    "write_kv_to_cache",
]


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
        "cpu": {AttentionBackendEnum.CPU_ATTN: "cpu.DDTreeCPUAttentionBackend"},
        "cuda": {
            AttentionBackendEnum.FLASH_ATTN: "cuda.DDTreeFlashAttentionBackend",
            AttentionBackendEnum.TRITON_ATTN: "cuda.DDTreeTritonAttentionBackend",
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
