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

from vllm.config.vllm import get_current_vllm_config_or_none
from vllm.v1.attention.backends.mla import flashattn_mla
from vllm.v1.attention.backends.mla.flashattn_mla import (
    FlashAttnMLABackend,
    FlashAttnMLAImpl,
    FlashAttnMLAMetadata,
    FlashAttnMLAMetadataBuilder,
)

from vllm_ddtree.attention.common import check_tree_support
from vllm_ddtree.attention.cpu_mla import (
    DDTreeCPUMLABackend,
    check_tree_rows_are_decodes,
)
from vllm_ddtree.attention.cuda_mla import MLACaptureMixin, flash_prefix_rows
from vllm_ddtree.attention.state import TreeAttentionInfo, current_tree
from vllm_ddtree.kernels.mla_tree_attention import mla_tree_attention_triton
from vllm_ddtree.sync import step_phase

__all__ = ["DDTreeFlashAttnMLABackend"]


@dataclass
class DDTreeFlashAttnMLAMetadata(FlashAttnMLAMetadata):
    tree: TreeAttentionInfo | None = None
    # The decode schedule is for flash_prefix_rows' call (non-causal over the
    # prefixes), not the parent's causal one.
    prefix_scheduled: bool = False


class DDTreeFlashAttnMLAMetadataBuilder(MLACaptureMixin, FlashAttnMLAMetadataBuilder):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.metadata_cls = DDTreeFlashAttnMLAMetadata
        self._prefix_scheduled = False

    def _schedule_decode(self, num_reqs, cu_query_lens, max_query_len, seqlens,
                         max_seq_len, causal, max_num_splits):
        tree = current_tree()
        if tree is not None and tree.skips_parent_attention:
            # The parent's causal call never runs this step: schedule the prefixes'.
            seqlens = seqlens - cu_query_lens.diff()
            causal = False
            self._prefix_scheduled = True
        return super()._schedule_decode(num_reqs, cu_query_lens, max_query_len, seqlens,
                                        max_seq_len, causal, max_num_splits)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self._prefix_scheduled = False
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        tree = current_tree()
        if tree is None or not tree.tree_reqs:
            return metadata
        tree.prepare_for(metadata.query_start_loc.device)
        check_tree_rows_are_decodes(tree, metadata.num_decode_tokens)
        metadata.tree = tree
        metadata.prefix_scheduled = self._prefix_scheduled
        return metadata


class DDTreeFlashAttnMLAImpl(FlashAttnMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = get_current_vllm_config_or_none()
        self._ddtree_max_len = config.model_config.max_model_len if config else None

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
                    scheduler_metadata=(decode.scheduler_metadata
                                        if attn_metadata.prefix_scheduled else None))
                return out, None
            out, _ = super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
            reqs = tree.req_index
            rows, _ = mla_tree_attention_triton(
                q_nope[tree.rows], q_pe[tree.rows], kv_c_and_k_pe_cache,
                decode.block_table[reqs], decode.seq_lens[reqs], tree.rows_query_start_loc,
                tree.packed_mask[reqs], self.scale, max_seq_len=self._ddtree_max_len)
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
