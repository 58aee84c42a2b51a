"""Tree attention on vLLM's CPU MLA backend (CPU_MLA).

An MLA layer keeps one latent row per token, ``[num_blocks, 16, kv_lora_rank +
rope_dim]`` (576 wide for DeepSeek-V3 and Kimi K2), and vLLM's MLA layer splits a
step in two: decode rows go to the backend's ``forward_mqa`` (absorbed MQA over the
latent cache), the others to ``forward_mha`` (prefill attention, causal).

vLLM's MLA builder counts only one-row requests as decodes, so a verify step's
``budget + 1`` rows per request would take the prefill path, causal over the
chain. The DDTree builder instead declares variable-length decodes: vLLM then
reorders the batch with threshold ``1 + num_speculative_tokens`` and sends every
verify row to ``forward_mqa``. CPU_MLA's decode kernel takes one query per
request, so the builder also lists each decode row as its own "request" (its
request's block table row, and the keys up to itself: causal), and keeps the
per-request tables beside them for the tree rows.

``forward_mqa`` then computes tree rows with the MLA tree twin
(``ops/mla_attention.py``, ``keys="all"``: the whole prefix plus each row's
ancestors). When every decode row is a tree row that is all; otherwise vLLM's
kernel first runs every decode row (a decode without drafts, a short prompt
counted as a decode) and the tree rows are overwritten, as ``attention/cpu.py``
does for dense layers. Prefill rows never meet a tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from vllm_ddtree.attention.common import check_tree_support, published_tree
from vllm_ddtree.attention.state import TreeAttentionInfo
from vllm_ddtree.ops.compaction import move_slots_per_layer
from vllm_ddtree.ops.mla_attention import mla_tree_attention
from vllm_ddtree.tensors import SlotMoves

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec

__all__ = ["DDTreeCPUMLABackend", "MLATreeBuilderMixin", "expand_decode_rows"]


class DDTreeCPUMLABackend(CPUMLABackend):
    """CPU_MLA plus ancestor-masked verify rows."""

    @staticmethod
    def get_impl_cls() -> type[DDTreeCPUMLAImpl]:
        return DDTreeCPUMLAImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeCPUMLAMetadataBuilder]:
        return DDTreeCPUMLAMetadataBuilder

    @staticmethod
    def move_kv_slots(
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
        moves: SlotMoves,
    ) -> None:
        """cache[dst] = old cache[src], one latent row per slot, in place. Indexing by
        (block, offset) reads any block stride (a cache group's pages may be padded)."""
        moved = kv_cache[moves.src_block, moves.src_offset]  # gather every source first
        kv_cache[moves.dst_block, moves.dst_offset] = moved

    @staticmethod
    def move_kv_slots_layers(
        kv_caches: list[torch.Tensor],  # per layer, as in move_kv_slots
        src_slots: torch.Tensor,  # [num_reqs, width] int64 flat slots
        dst_slots: torch.Tensor,  # [num_reqs, width] int64
    ) -> None:
        """Compaction's KV moves for every layer of a cache group, layer by layer."""
        move_slots_per_layer(DDTreeCPUMLABackend.move_kv_slots, kv_caches,
                             src_slots, dst_slots, block_size=kv_caches[0].shape[1])


@dataclass
class DDTreeMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata with one entry per decode row (``block_table``,
    ``seq_lens``: what CPU_MLA's one-query kernel reads), plus the per-request
    tables the tree rows are computed from."""

    request_block_table: torch.Tensor  # [num_decodes, max_blocks_per_req] int32
    request_seq_lens: torch.Tensor  # [num_decodes] int32, including the query rows


@dataclass
class DDTreeCPUMLAMetadata(MLACommonMetadata[DDTreeMLADecodeMetadata]):
    tree: TreeAttentionInfo | None = None


class MLATreeBuilderMixin:
    """Attaches the published tree to an MLA builder's metadata (every DDTree MLA
    backend's builder: CPU_MLA here, TRITON_MLA and FLASH_ATTN_MLA on CUDA), after
    checking that vLLM counted every tree row as a decode."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        tree = published_tree(metadata.query_start_loc.device)
        if tree is None:
            return metadata
        check_tree_rows_are_decodes(tree, metadata.num_decode_tokens)
        metadata.tree = tree
        return metadata


class DDTreeCPUMLAMetadataBuilder(
    MLATreeBuilderMixin, MLACommonMetadataBuilder[DDTreeCPUMLAMetadata]
):
    """vLLM's MLA builder with variable-length decodes (verify rows included) and
    the step's published tree attached.

    vLLM's MLA builder makes its metadata class itself (``metadata_cls`` is an
    ``__init__`` argument there), so the tree is set on the metadata it returns
    instead of being copied in as ``TreeMetadataBuilderMixin`` does for builders
    whose metadata class is fixed.
    """

    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                         metadata_cls=DDTreeCPUMLAMetadata)

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        max_query_len: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> DDTreeMLADecodeMetadata:
        row_block_table, row_seq_lens = expand_decode_rows(
            block_table_tensor, seq_lens_device, query_start_loc_cpu, num_decode_tokens
        )
        return DDTreeMLADecodeMetadata(
            block_table=row_block_table,
            seq_lens=row_seq_lens,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            request_block_table=block_table_tensor,
            request_seq_lens=seq_lens_device,
        )


class DDTreeCPUMLAImpl(CPUMLAImpl):
    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # [rows, heads, rank | rope]
        kv_c_and_k_pe_cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
        attn_metadata: DDTreeCPUMLAMetadata,
        layer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # latent [rows, heads, rank], no LSE
        tree = getattr(attn_metadata, "tree", None)
        if tree is None:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        check_tree_support(self)
        q_nope, q_pe = q if isinstance(q, tuple) else q.split(
            [self.kv_lora_rank, q.shape[-1] - self.kv_lora_rank], dim=-1
        )
        if tree.rows.shape[0] == attn_metadata.num_decode_tokens:
            out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.kv_lora_rank)
        else:  # decode rows outside the trees take vLLM's kernel (module docstring)
            out, _ = super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        decode, reqs = attn_metadata.decode, tree.req_index
        result, _ = mla_tree_attention(
            q_nope[tree.rows], q_pe[tree.rows], kv_c_and_k_pe_cache,
            decode.request_block_table[reqs], decode.request_seq_lens[reqs],
            tree.rows_query_start_loc, tree.tree_mask[reqs], self.scale, keys="all",
        )
        out[tree.rows] = result.to(out.dtype)
        return out, None


def expand_decode_rows(
    block_table: torch.Tensor,  # [num_decodes, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_decodes] int32, including the query rows
    query_start_loc: torch.Tensor,  # [num_decodes + 1] int32 on the host
    num_rows: int,  # decode rows, query_start_loc[-1]
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_rows, max_blocks] int32, [num_rows] int32
    """Each decode row as a one-query request: its request's block table row, and as
    keys every position up to its own (row i of a request with q rows and seq_len s
    sees s - (q - 1 - i) keys), so a one-query kernel computes causal attention."""
    device = block_table.device
    query_lens = query_start_loc.diff().to(torch.int64)
    req = torch.repeat_interleave(torch.arange(query_lens.shape[0]), query_lens,
                                  output_size=num_rows)
    rows_after = query_start_loc[1:].to(torch.int64)[req] - 1 - torch.arange(num_rows)
    req = req.to(device)
    row_seq_lens = seq_lens[req] - rows_after.to(device, seq_lens.dtype)
    return block_table[req], row_seq_lens


def check_tree_rows_are_decodes(tree: TreeAttentionInfo, num_decode_tokens: int) -> None:
    """Tree rows reach forward_mqa only if vLLM counted their requests as decodes
    (query rows within its reorder threshold, 1 + num_speculative_tokens)."""
    reqs = torch.tensor(tree.tree_reqs)
    last_row = int((tree.row_start[reqs] + tree.num_rows[reqs]).max())
    if last_row > num_decode_tokens:
        raise RuntimeError(
            f"DDTree verify rows up to row {last_row} but vLLM's MLA builder counted "
            f"only the first {num_decode_tokens} rows as decodes; tree rows would take "
            "the causal prefill path. The batch's decode/prefill reorder threshold is "
            "below the verify width (budget + 1)."
        )
