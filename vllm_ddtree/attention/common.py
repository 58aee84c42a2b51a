"""What every DDTree attention backend shares: the metadata hook and the feature check."""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

from vllm.v1.attention.backend import AttentionCGSupport

from vllm_ddtree.attention.state import current_tree


class TreeMetadataBuilderMixin:
    """Attaches the published tree to the parent builder's metadata.

    ``metadata_cls`` is the parent's metadata dataclass plus a ``tree`` field.
    Builds outside the target's metadata step (the drafter's) see no tree.
    """

    # CPU: no graphs. CUDA builders declare UNIFORM_BATCH (attention/cuda.py).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    metadata_cls: ClassVar[type]

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        tree = current_tree()
        if tree is None or not tree.tree_reqs:
            return metadata
        tree.prepare_for(metadata.query_start_loc.device)
        values = {f.name: getattr(metadata, f.name) for f in fields(metadata)}
        return self.metadata_cls(**values, tree=tree)


def check_tree_support(impl, output_scale=None, output_block_scale=None) -> None:
    """Features the tree kernels do not implement fail at the first tree, by name."""
    window = getattr(impl, "sliding_window", None)
    unsupported = {
        "sliding window": window not in (None, -1, (-1, -1), [-1, -1]),
        "ALiBi": getattr(impl, "alibi_slopes", None) is not None,
        "logits soft cap": bool(getattr(impl, "logits_soft_cap", None)),
        "attention sinks": getattr(impl, "sinks", None) is not None,
        "quantized KV cache": not str(getattr(impl, "kv_cache_dtype", "auto")).startswith(
            ("auto", "bfloat16", "float16", "float32")
        ),
        "fused output quantization": output_scale is not None or output_block_scale is not None,
    }
    bad = [name for name, present in unsupported.items() if present]
    if bad:
        raise NotImplementedError(
            f"DDTree tree attention does not support {', '.join(bad)}."
        )
