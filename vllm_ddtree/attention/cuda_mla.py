"""Tree attention on vLLM's CUDA MLA backend TRITON_MLA.

An MLA layer keeps one latent row per token, ``[num_blocks, block_size, kv_lora_rank
+ rope_dim]`` (576 wide for DeepSeek-V3 and Kimi K2), and vLLM's MLA layer sends decode
rows to the backend's ``forward_mqa`` (absorbed MQA over the latent cache) and the
others to ``forward_mha`` (prefill attention, causal).

As on CPU_MLA (``cpu_mla.py``) the DDTree builder declares variable-length decodes,
so vLLM's reorder threshold of ``1 + num_speculative_tokens`` sends every verify row
to ``forward_mqa``, whatever size the step's trees are. TRITON_MLA's own decode
kernel takes uniform decode blocks with causal extents only, so a DDTree engine's
``forward_mqa`` runs every decode row through the plugin's MLA kernel
(``kernels/mla_tree_attention.py``, long prefixes split over the SMs): tree rows over
their prefix and ancestors, other decode rows (a decode without drafts, a short prompt
counted as a decode) causal over their block. One launch when every row is a tree row (the steady state, which vLLM
captures in full CUDA graphs: the kernel reads the persistent block tables, sequence
lengths, query offsets and the runner's mask buffer, and finds each row's request on
the device); otherwise a causal launch over the decode rows and a masked one over the
tree rows.

TRITON_MLA runs in fp16 and bf16 (vLLM's own limit); a quantized (fp8) latent cache
is refused at the first decode, by name. FLASH_ATTN_MLA, FLASHMLA and the other CUDA
MLA backends have no tree path yet: ``--attention-backend TRITON_MLA`` picks this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config.vllm import get_current_vllm_config_or_none
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    QueryLenSupport,
)
from vllm.v1.attention.backends.mla.triton_mla import (
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
)

from vllm_ddtree.attention.common import check_tree_support
from vllm_ddtree.attention.cpu_mla import DDTreeCPUMLABackend, MLATreeBuilderMixin
from vllm_ddtree.attention.state import TreeAttentionInfo
from vllm_ddtree.kernels.mla_tree_attention import mla_tree_attention_triton
from vllm_ddtree.sync import step_phase

__all__ = ["DDTreeTritonMLABackend", "MLACaptureMixin", "decode_rows_attention",
           "flash_prefix_rows", "model_max_len", "tree_rows_attention"]


@dataclass
class DDTreeMLAMetadata(MLACommonMetadata[MLACommonDecodeMetadata]):
    tree: TreeAttentionInfo | None = None


class MLACaptureMixin:
    """The parent's capture build with every dummy decode's ``seq_len`` at least its
    query rows where a tree is published (as ``TreeMetadataBuilderMixin`` does for the
    dense builders): vLLM captures decodes with ``seq_lens`` of 1, and a tree row reads
    ``seq_len - rows`` prefix keys, so less than none would send the capture's run to
    key positions below 0. Replays read the real step's lengths from the same buffer."""

    def build_for_cudagraph_capture(self, common_attn_metadata):
        metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        if getattr(metadata, "tree", None) is not None and metadata.decode is not None:
            seq_lens = metadata.decode.seq_lens
            query_lens = metadata.query_start_loc.diff()[: seq_lens.shape[0]]
            torch.maximum(seq_lens, query_lens.to(seq_lens.dtype), out=seq_lens)
        return metadata


class DDTreeTritonMLAMetadataBuilder(MLACaptureMixin, MLATreeBuilderMixin,
                                     TritonMLAMetadataBuilder):
    """TRITON_MLA's builder with variable-length decodes (verify rows of any tree
    size) and the step's published tree attached."""

    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.metadata_cls = DDTreeMLAMetadata  # vLLM's MLA builder makes this class


def decode_rows_attention(
    q_nope: torch.Tensor,  # [rows, heads, kv_lora_rank], W_UK absorbed
    q_pe: torch.Tensor,  # [rows, heads, rope_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_decodes] int32, query rows included
    query_start_loc: torch.Tensor,  # [num_decodes + 1] int32, over the decode rows
    tree: TreeAttentionInfo | None,
    scale: float,
    max_seq_len: int | None = None,  # the model's: KV splits fixed for every step
) -> torch.Tensor:  # latent [rows, heads, kv_lora_rank]
    """Every decode row's latent attention: tree rows over their prefix and tree
    ancestors, the other rows causal over their request's block (module docstring)."""
    if tree is not None and tree.all_rows_are_tree_rows:
        num_reqs = tree.num_reqs
        out, _ = mla_tree_attention_triton(
            q_nope, q_pe, kv_cache, block_table[:num_reqs], seq_lens[:num_reqs],
            query_start_loc[: num_reqs + 1], tree.packed_mask, scale,
            max_seq_len=max_seq_len)
        return out
    out, _ = mla_tree_attention_triton(q_nope, q_pe, kv_cache, block_table, seq_lens,
                                       query_start_loc, None, scale, max_seq_len=max_seq_len)
    if tree is not None:
        out[tree.rows] = tree_rows_attention(q_nope, q_pe, kv_cache, block_table, seq_lens,
                                             tree, scale, max_seq_len)
    return out


def tree_rows_attention(
    q_nope: torch.Tensor,  # [rows, heads, kv_lora_rank], every decode row
    q_pe: torch.Tensor,  # [rows, heads, rope_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_decodes] int32, query rows included
    tree: TreeAttentionInfo,
    scale: float,
    max_seq_len: int | None,
) -> torch.Tensor:  # latent [tree rows, heads, kv_lora_rank], in tree.rows order
    """The tree rows alone, over their prefix and ancestors: a step whose other decode
    rows took another path (the backend's kernel, or the causal launch)."""
    reqs = tree.req_index
    rows, _ = mla_tree_attention_triton(
        q_nope[tree.rows], q_pe[tree.rows], kv_cache, block_table[reqs], seq_lens[reqs],
        tree.rows_query_start_loc, tree.packed_mask[reqs], scale, max_seq_len=max_seq_len)
    return rows


def model_max_len() -> int | None:
    """The engine's max_model_len, read when a layer's impl is made: it sizes the MLA
    kernel's KV splits, the same at graph capture and at every step."""
    config = get_current_vllm_config_or_none()
    return config.model_config.max_model_len if config else None


def flash_prefix_rows(
    flash_attn_varlen_func,  # vLLM's FlashAttention 3 entry (its MLA form, q_v)
    q_nope: torch.Tensor,  # [rows, heads, kv_lora_rank], W_UK absorbed
    q_pe: torch.Tensor,  # [rows, heads, rope_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, verify rows included
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    packed_mask: torch.Tensor,  # [num_reqs, width, words] int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int,
    scheduler_metadata: torch.Tensor | None,
) -> torch.Tensor:  # latent [rows, heads, kv_lora_rank]
    """FLASH_ATTN_MLA's steady state (every row a tree row): FlashAttention 3,
    non-causal, over each request's prefix alone (``seq_len`` less its rows) with its
    LSE, then the MLA tree kernel resumes that softmax over the tree keys. The
    schedule, when given, is the builder's, made for exactly this call."""
    rank = q_nope.shape[-1]
    prefix_lens = seq_lens - query_start_loc.diff()
    out, lse = flash_attn_varlen_func(
        q=q_pe, k=kv_cache[..., rank:].unsqueeze(-2), v=kv_cache[..., :rank].unsqueeze(-2),
        q_v=q_nope, max_seqlen_q=max(max_query_len, 1), cu_seqlens_q=query_start_loc,
        max_seqlen_k=max_seq_len, seqused_k=prefix_lens, block_table=block_table,
        softmax_scale=scale, causal=False, return_softmax_lse=True, fa_version=3,
        scheduler_metadata=scheduler_metadata, num_splits=num_splits,
    )
    out, _ = mla_tree_attention_triton(q_nope, q_pe, kv_cache, block_table, seq_lens,
                                       query_start_loc, packed_mask, scale, "all", out, lse)
    return out


class DDTreeTritonMLAImpl(TritonMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ddtree_max_len = model_max_len()

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # [rows, heads, rank | rope]
        kv_c_and_k_pe_cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
        attn_metadata: DDTreeMLAMetadata,
        layer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # latent [rows, heads, rank], no LSE
        if not getattr(self, "_ddtree_checked", False):
            check_tree_support(self)  # a quantized latent cache stops here, by name
            self._ddtree_checked = True
        q_nope, q_pe = q if isinstance(q, tuple) else q.split(
            [self.kv_lora_rank, q.shape[-1] - self.kv_lora_rank], dim=-1
        )
        num_decodes = attn_metadata.num_decodes
        tree = getattr(attn_metadata, "tree", None)
        with step_phase("ddtree.mla_tree_attention", q_nope.device):
            out = decode_rows_attention(
                q_nope, q_pe, kv_c_and_k_pe_cache, attn_metadata.decode.block_table,
                attn_metadata.decode.seq_lens, attn_metadata.query_start_loc[: num_decodes + 1],
                tree, self.scale, self._ddtree_max_len,
            )
        return out, None


class DDTreeTritonMLABackend(TritonMLABackend):
    """TRITON_MLA plus ancestor-masked verify rows."""

    @staticmethod
    def get_impl_cls() -> type[DDTreeTritonMLAImpl]:
        return DDTreeTritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeTritonMLAMetadataBuilder]:
        return DDTreeTritonMLAMetadataBuilder

    # One latent row per slot, as on CPU_MLA: the same moves.
    move_kv_slots = staticmethod(DDTreeCPUMLABackend.move_kv_slots)
    move_kv_slots_layers = staticmethod(DDTreeCPUMLABackend.move_kv_slots_layers)
