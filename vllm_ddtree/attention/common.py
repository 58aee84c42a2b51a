"""What every DDTree attention backend shares: the metadata hook and the feature check."""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport

from vllm_ddtree.attention.state import TreeAttentionInfo, current_tree


def published_tree(device: torch.device) -> TreeAttentionInfo | None:
    """The step's published tree, its tensors on ``device``, for a metadata build;
    None where the build has none (no tree rows, or the drafter's build)."""
    tree = current_tree()
    if tree is None or not tree.tree_reqs:
        return None
    tree.prepare_for(device)
    return tree


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
        tree = published_tree(metadata.query_start_loc.device)
        if tree is None:
            return metadata
        if type(metadata) is self.metadata_cls.__base__:
            # The parent's metadata as it is plus the tree, without a second pass
            # through the dataclass's __init__ (this runs at every verify step).
            with_tree = object.__new__(self.metadata_cls)
            with_tree.__dict__.update(metadata.__dict__, tree=tree)
            return with_tree
        values = {f.name: getattr(metadata, f.name) for f in fields(metadata)}
        return self.metadata_cls(**values, tree=tree)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """The parent's capture build, with every dummy request's ``seq_len`` at least
        its query rows where a tree is published. vLLM's Triton builder captures with
        ``seq_lens`` of 1 (a decode step's), but a tree row reads ``seq_len - rows``
        prefix keys: less than none would send the capture's warm-up run, and the
        graph's kernels, to key positions below 0 (an illegal address on vLLM's V2
        runner). Replays read the real step's ``seq_lens`` from the same buffer."""
        metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        if getattr(metadata, "tree", None) is not None:
            seq_lens = metadata.seq_lens
            query_lens = metadata.query_start_loc.diff()[: seq_lens.shape[0]]
            torch.maximum(seq_lens, query_lens.to(seq_lens.dtype), out=seq_lens)
        return metadata


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
