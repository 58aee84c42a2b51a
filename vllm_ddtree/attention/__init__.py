"""Tree attention for DDTree verify rows: plain-torch reference and cache helpers."""

from vllm_ddtree.attention.reference import (
    pack_tree_mask,
    tree_attention_reference,
    unpack_tree_mask,
    write_kv_to_cache,
)

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
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    if str(device).startswith("cpu"):
        register_backend(
            AttentionBackendEnum.CPU_ATTN,
            "vllm_ddtree.attention.cpu.DDTreeCPUAttentionBackend",
        )
        return
    raise NotImplementedError(
        f"DDTree has no tree-attention backend for device {device!r} yet."
    )
