"""Tree attention on vLLM's CPU backend (CPU_ATTN).

The verify rows of requests that carry a tree are computed under their ancestor
masks, all requests of the step in one batched torch pass (ops/attention.py). When
every row of the step is such a row (a decode step whose requests all carry
drafts) that pass is all; otherwise the platform kernel first runs every row as
usual (prefill, chunked prefill, plain decode) and the tree rows are then
overwritten, double work on a few rows that is cheap next to the model's GEMMs.

CPU_ATTN's cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
per layer; within each (block, head) the first ``block_size * head_dim``
elements hold K transposed (``[head_dim, block_size]``) and the rest hold V
(``[block_size, head_dim]``), for the ``vec``/``vec16`` kernels that fp32 and
bf16 use on x86 and Arm without AMX.

Page size. vLLM's CPU_ATTN declares multiples of 32, but on x86 its ``vec16``
kernel (fp32, bf16 and fp16, every head size CPU_ATTN takes; not fp8 caches)
runs pages of 16, and vLLM picks that kernel for any page that is not a multiple
of 32, AMX machines in bf16 included. A DDTree engine's drafter layers therefore
also declare 16, the only page CPU_MLA runs: an MLA target and its DFlash
drafter share one KV-cache group, hence one page size. On Arm the NEON kernel
needs multiples of 32, so nothing is added there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.platforms import CpuArchEnum, current_platform
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.attention.common import TreeMetadataBuilderMixin, check_tree_support
from vllm_ddtree.attention.state import TreeAttentionInfo
from vllm_ddtree.ops.attention import (
    plan_tree_attention_torch,
    run_tree_attention_torch,
)
from vllm_ddtree.ops.compaction import move_slots_per_layer
from vllm_ddtree.tensors import SlotMoves

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

# Cache interiors this module knows how to read (see the module docstring).
_PLAIN_ISAS = ("vec", "vec16", "neon")
VEC16_PAGE = 16  # the page of vLLM's vec16 kernel, and the only one CPU_MLA runs


class DDTreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN plus ancestor-masked verify rows."""

    @staticmethod
    def get_impl_cls() -> type[DDTreeCPUAttentionImpl]:
        return DDTreeCPUAttentionImpl

    @staticmethod
    def get_supported_kernel_block_sizes(
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> list[int | MultipleOf]:
        """vLLM's sizes, plus 16 where its ``vec16`` kernel runs them (module docstring)."""
        sizes = CPUAttentionBackend.get_supported_kernel_block_sizes(kv_cache_spec)
        quantized = bool(getattr(kv_cache_spec, "kv_quant_mode", 0))  # vec16 has no fp8
        if current_platform.get_cpu_architecture() == CpuArchEnum.X86 and not quantized:
            return [VEC16_PAGE, *sizes]
        return sizes

    @staticmethod
    def get_builder_cls() -> type[DDTreeCPUAttentionMetadataBuilder]:
        return DDTreeCPUAttentionMetadataBuilder

    @staticmethod
    def move_kv_slots(
        kv_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, 2 * head_dim]
        moves: SlotMoves,
    ) -> None:
        """cache[dst] = old cache[src] for K and V of every head, in place."""
        for cache in split_kv_cache(kv_cache):  # [nb, bs, h, d] strided views
            moved = cache[moves.src_block, moves.src_offset]  # gather every source first
            cache[moves.dst_block, moves.dst_offset] = moved

    @staticmethod
    def move_kv_slots_layers(
        kv_caches: list[torch.Tensor],  # per layer, as in move_kv_slots
        src_slots: torch.Tensor,  # [num_reqs, width] int64 flat slots
        dst_slots: torch.Tensor,  # [num_reqs, width] int64
    ) -> None:
        """Compaction's KV moves for every layer of a cache group, layer by layer."""
        move_slots_per_layer(DDTreeCPUAttentionBackend.move_kv_slots, kv_caches,
                             src_slots, dst_slots, block_size=kv_caches[0].shape[2])


@dataclass
class DDTreeCPUAttentionMetadata(CPUAttentionMetadata):
    tree: TreeAttentionInfo | None = None


class DDTreeCPUAttentionMetadataBuilder(
    TreeMetadataBuilderMixin, CPUAttentionMetadataBuilder
):
    metadata_cls = DDTreeCPUAttentionMetadata


class DDTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(
        self,
        layer,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tree = getattr(attn_metadata, "tree", None)
        if tree is None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )
        self._check_tree_support(layer)
        if tree.rows.shape[0] != attn_metadata.num_actual_tokens:
            # Rows outside the trees (a prefill chunk, a decode without drafts) take
            # vLLM's kernel; it runs over every row, and the tree rows are then
            # overwritten. When every row is a tree row it is skipped.
            super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )
        key_cache, value_cache = split_kv_cache(kv_cache)
        reqs = tree.req_index  # rows and indices from the builder's prepare_for
        # One plan per step and metadata (a KV-cache group's layers share both).
        plan_key = ("torch_tree", attn_metadata.block_table.data_ptr(),
                    attn_metadata.seq_lens.data_ptr(), self.num_heads, key_cache.shape[1])
        plan = tree.attention_plans.get(plan_key)
        if plan is None:
            plan = tree.attention_plans[plan_key] = plan_tree_attention_torch(
                attn_metadata.block_table[reqs],
                attn_metadata.seq_lens[reqs],
                tree.rows_query_start_loc,
                tree.tree_mask[reqs],
                self.num_heads,
                key_cache.shape[1],
            )
        result = run_tree_attention_torch(
            plan, query[tree.rows], key_cache, value_cache, self.scale
        )
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        out[tree.rows] = result.to(out.dtype)
        return output

    def _check_tree_support(self, layer) -> None:
        check_tree_support(self)
        isa = getattr(layer, "isa", "vec")
        if isa not in _PLAIN_ISAS:
            raise NotImplementedError(
                f"DDTree tree attention on CPU reads the KV cache of the "
                f"{_PLAIN_ISAS} kernels; this layer uses {isa!r} (e.g. AMX for "
                "bf16). Use dtype float32."
            )


def split_kv_cache(
    kv_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, 2 * head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as strided ``[num_blocks, block_size, num_kv_heads, head_dim]`` views."""
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    flat = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_dim)
    key_t = flat[:, :, 0].view(num_blocks, num_kv_heads, head_dim, block_size)
    value = flat[:, :, 1].view(num_blocks, num_kv_heads, block_size, head_dim)
    return key_t.permute(0, 3, 1, 2), value.permute(0, 2, 1, 3)

