"""Tree attention on vLLM's FLASH_ATTN_MLA backend (FlashAttention 3 over the latent
cache; vLLM's pick for bf16 MLA on Hopper).

The parent already sends variable-length decodes (every verify row) to
``forward_mqa``, causal. In a DDTree engine:

- a step whose every row is a tree row (the steady state, captured in full CUDA
  graphs) runs FlashAttention 3 non-causal over each request's prefix alone with its
  LSE, then the MLA tree kernel resumes over the tree keys (``cuda_mla.flash_prefix_rows``),
  as FLASH_ATTN's split does for dense layers (``cuda.flash_prefix_step``). The builder
  makes FlashAttention's schedule ahead for exactly that call (non-causal, prefix
  lengths), as vLLM makes it for its causal one;
- a mixed step runs the parent (causal over every decode row), then the tree rows again
  through the MLA tree kernel alone (prefix and ancestors).

Decode context parallelism and fp8 caches are refused at the first tree, by name. This
module imports vLLM's FlashAttention bindings, present on CUDA builds only.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.attention.backends.mla import flashattn_mla
from vllm.v1.attention.backends.mla.flashattn_mla import (
    FlashAttnMLABackend,
    FlashAttnMLAImpl,
    FlashAttnMLAMetadata,
    FlashAttnMLAMetadataBuilder,
)

from vllm_ddtree.attention.common import check_tree_support
from vllm_ddtree.attention.cpu_mla import DDTreeCPUMLABackend, MLATreeBuilderMixin
from vllm_ddtree.attention.cuda_mla import (
    MLACaptureMixin,
    flash_prefix_rows,
    model_max_len,
    tree_rows_attention,
)
from vllm_ddtree.attention.state import TreeAttentionInfo, current_tree
from vllm_ddtree.sync import step_phase

__all__ = ["DDTreeFlashAttnMLABackend"]


@dataclass
class DDTreeFlashAttnMLAMetadata(FlashAttnMLAMetadata):
    tree: TreeAttentionInfo | None = None


class DDTreeFlashAttnMLAMetadataBuilder(MLACaptureMixin, MLATreeBuilderMixin,
                                        FlashAttnMLAMetadataBuilder):
    """In a step whose every row is a tree row, the decode schedule
    (``decode.scheduler_metadata``) is made for flash_prefix_rows' call, non-causal
    over the prefixes: the parent's causal call never runs there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.metadata_cls = DDTreeFlashAttnMLAMetadata

    def _schedule_decode(self, num_reqs, cu_query_lens, max_query_len, seqlens,
                         max_seq_len, causal, max_num_splits):
        tree = current_tree()
        if tree is not None and tree.skips_parent_attention:
            seqlens = seqlens - cu_query_lens.diff()
            causal = False
        return super()._schedule_decode(num_reqs, cu_query_lens, max_query_len, seqlens,
                                        max_seq_len, causal, max_num_splits)


class DDTreeFlashAttnMLAImpl(FlashAttnMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ddtree_max_len = model_max_len()

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        tree: TreeAttentionInfo | None = getattr(attn_metadata, "tree", None)
        if tree is None:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        if not getattr(self, "_ddtree_checked", False):
            check_tree_support(self)
            if self.dcp_world_size > 1:
                raise NotImplementedError(
                    "DDTree tree attention on FLASH_ATTN_MLA does not support decode "
                    "context parallelism.")
            self._ddtree_checked = True
        q_nope, q_pe = q if isinstance(q, tuple) else q.split(
            [self.kv_lora_rank, q.shape[-1] - self.kv_lora_rank], dim=-1)
        decode = attn_metadata.decode
        with step_phase("ddtree.mla_tree_attention", q_nope.device):
            if tree.all_rows_are_tree_rows:
                num_reqs = tree.num_reqs
                out = flash_prefix_rows(
                    flashattn_mla.flash_attn_varlen_func, q_nope, q_pe,
                    kv_c_and_k_pe_cache, decode.block_table[:num_reqs],
                    decode.seq_lens[:num_reqs], decode.query_start_loc[: num_reqs + 1],
                    tree.packed_mask, self.scale, max_query_len=tree.width,
                    max_seq_len=decode.max_seq_len, num_splits=decode.max_num_splits,
                    scheduler_metadata=decode.scheduler_metadata)
                return out, None
            out, _ = super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
            rows = tree_rows_attention(q_nope, q_pe, kv_c_and_k_pe_cache, decode.block_table,
                                       decode.seq_lens, tree, self.scale, self._ddtree_max_len)
            out[tree.rows] = rows.to(out.dtype)
        return out, None


class DDTreeFlashAttnMLABackend(FlashAttnMLABackend):
    """FLASH_ATTN_MLA plus ancestor-masked verify rows."""

    @staticmethod
    def get_impl_cls() -> type[DDTreeFlashAttnMLAImpl]:
        return DDTreeFlashAttnMLAImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeFlashAttnMLAMetadataBuilder]:
        return DDTreeFlashAttnMLAMetadataBuilder

    move_kv_slots = staticmethod(DDTreeCPUMLABackend.move_kv_slots)
    move_kv_slots_layers = staticmethod(DDTreeCPUMLABackend.move_kv_slots_layers)
