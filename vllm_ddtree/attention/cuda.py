"""Tree attention on vLLM's CUDA backends (FLASH_ATTN and TRITON_ATTN).

Each DDTree backend subclasses the platform backend and changes only the rows
of requests that carry a tree; everything else (prefill, chunked prefill,
plain decode, the drafter's own layers, the KV-cache write) stays the
parent's:

- a step in which every request is a tree verify (the steady state of
  decoding) runs :func:`tree_attention_triton` over the whole batch and skips
  the parent's kernel;
- a mixed step (some requests prefilling) runs the parent over every row,
  then recomputes the tree requests' rows with the tree kernel.

On FLASH_ATTN with FlashAttention 3 in 16 bits, a steady-state step
(``ddtree_prefix_attention`` "auto", the default, or "flash_attn") splits each
layer's tree attention in two:
FlashAttention, non-causal, over each request's prefix alone (``seqused_k =
seq_len - query_len``), returning its LSE; then the tree kernel starts from that
partial softmax and attends to the tree keys only (:func:`flash_prefix_step`).
FlashAttention 3 is about 1.8x faster than the tree kernel over a long prefix
(benchmarks/results/tree_attention_h200.json), and the tree keys are at most budget + 1.

CUDA graphs: the builders declare ``UNIFORM_BATCH`` support, so vLLM captures
full graphs for uniform batches of ``budget + 1`` query rows per request (the
steady state of tree decoding) and piecewise graphs, with attention run
eagerly between them, for every other batch. A full graph holds the tree
kernel with its launch plan; each step's masks reach it through the runner's
persistent mask buffer (attention/state.py), and block tables, sequence
lengths and query offsets through vLLM's own persistent buffers. The graph is
captured with a causal tree (the capture's batch has none), and the runner
lets only steps whose every row is a tree row replay it; a uniform batch
without trees (a prefill chunk of exactly ``budget + 1`` tokens) runs
piecewise, with the parent's kernel.

Both parents keep each layer's cache as ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` in logical order, K in the first half of the last
dimension and V in the second; :func:`split_kv_cache` gives the strided
``[num_blocks, block_size, num_kv_heads, head_size]`` views the kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.config.vllm import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends import flash_attn as flash_attn_backend
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree.attention.common import TreeMetadataBuilderMixin, check_tree_support
from vllm_ddtree.attention.state import TreeAttentionInfo, current_tree
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.kernels.tree_attention import (
    launch_tree_attention,
    tree_attention_triton,
)
from vllm_ddtree.kernels.tree_attention_plan import plan_signature, plan_tree_attention
from vllm_ddtree.ops.compaction import move_slots_per_layer
from vllm_ddtree.sync import step_phase
from vllm_ddtree.tensors import SlotMoves

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers


def split_kv_cache(
    kv_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as strided ``[num_blocks, block_size, num_kv_heads, head_size]`` views."""
    head_size = kv_cache.shape[-1] // 2
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def move_kv_slots(
    kv_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
    moves: SlotMoves,
) -> None:
    """cache[dst] = old cache[src] for K and V of every head, in place, no sync."""
    per_slot = kv_cache.transpose(1, 2)  # [num_blocks, block_size, heads, 2 * head_size]
    if per_slot.dtype.itemsize == 1 and per_slot.is_floating_point():
        per_slot = per_slot.view(torch.uint8)  # fp8 caches move as raw bytes
    # The right-hand side is a gather into a new tensor: every source is read
    # before any destination is written, so overlapping moves are safe.
    per_slot[moves.dst_block, moves.dst_offset] = per_slot[moves.src_block, moves.src_offset]


def move_kv_slots_layers(
    kv_caches: list[torch.Tensor],  # per layer [num_blocks, num_kv_heads, block_size, 2 * head_size]
    src_slots: torch.Tensor,  # [num_reqs, width] int64 flat slots, moves in depth order
    dst_slots: torch.Tensor,  # [num_reqs, width] int64
) -> None:
    """Compaction's KV moves for every layer of a cache group, layer by layer with
    :func:`move_kv_slots`: for caches the one-launch kernel cannot take
    (kernels.kv_move.compact_kv_triton, which the runner calls directly)."""
    move_slots_per_layer(move_kv_slots, kv_caches, src_slots, dst_slots,
                         block_size=kv_caches[0].shape[2])


def tree_attention_step(
    tree: TreeAttentionInfo,
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *metadata: Any,  # block_table, seq_lens, query_start_loc, packed mask, scale
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor,
) -> None:
    """tree_attention_triton over the whole batch, with its plan (checks, tiles,
    splits, scratch) made by the step's first layer and reused by the others.
    Plans are kept by shapes and by the metadata's storage: KV-cache groups with
    alike layers still have block tables of their own."""
    storage = tuple(t.data_ptr() for t in metadata if isinstance(t, torch.Tensor))
    key = (plan_signature(query, key_cache, value_cache, out), storage)
    plan = tree.attention_plans.get(key)
    if plan is None:
        plan = tree.attention_plans[key] = plan_tree_attention(
            query, key_cache, value_cache, *metadata,
            max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
        )
    launch_tree_attention(plan, query, key_cache, value_cache, out)


def flash_prefix_step(
    tree: TreeAttentionInfo,
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, verify tokens included
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    packed_mask: torch.Tensor,  # [num_reqs, width, words] int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int,
    fa_version: int,
    out: torch.Tensor,
    scheduler_metadata: torch.Tensor | None = None,  # FA3's schedule of this prefix call
) -> None:
    """Tree attention as FlashAttention over the prefixes plus the tree kernel over
    the trees, merged by LSE; the plan and the prefix lengths are made by the step's
    first layer and reused by the others (as in :func:`tree_attention_step`). With
    ``scheduler_metadata`` (the builder's, made ahead for exactly this call:
    DDTreeFlashAttentionMetadataBuilder) FlashAttention 3 skips planning its tiles in
    every layer."""
    metadata = (block_table, seq_lens, query_start_loc, packed_mask)
    storage = tuple(t.data_ptr() for t in metadata)
    key = ("flash_prefix", plan_signature(query, key_cache, value_cache, out), storage)
    entry = tree.attention_plans.get(key)
    if entry is None:
        plan = plan_tree_attention(
            query, key_cache, value_cache, *metadata, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
            prefix_given=True,
        )
        prefix_lens = seq_lens - query_start_loc.diff()  # [num_reqs] int32, on the device
        entry = tree.attention_plans[key] = (plan, prefix_lens)
    plan, prefix_lens = entry
    _, prefix_lse = flash_attn_backend.flash_attn_varlen_func(
        q=query, out=out,
        # FA3's TMA wants 16-byte strides on size-1 dims too (one KV head under TP).
        k=canonicalize_singleton_dim_strides(key_cache),
        v=canonicalize_singleton_dim_strides(value_cache),
        cu_seqlens_q=query_start_loc, max_seqlen_q=max_query_len,
        seqused_k=prefix_lens, max_seqlen_k=max_seq_len,
        softmax_scale=scale, causal=False, block_table=block_table,
        return_softmax_lse=True, fa_version=fa_version, num_splits=num_splits,
        scheduler_metadata=scheduler_metadata,
    )
    launch_tree_attention(plan, query, key_cache, value_cache, out, prefix_lse)


def prefix_on_flash_attn(choice: str, fa_version: int | None, dtype: torch.dtype) -> bool:
    """Whether FlashAttention takes the verify rows' prefix (ddtree_prefix_attention):
    FlashAttention 3 in fp16/bf16 only; asked for where it cannot run, say why."""
    usable = fa_version == 3 and dtype in (torch.float16, torch.bfloat16)
    if choice == "flash_attn" and not usable:
        raise ValueError(
            f"ddtree_prefix_attention='flash_attn' needs FlashAttention 3 and fp16 or "
            f"bf16 attention; this layer runs FlashAttention {fa_version} in {dtype}. "
            f"Use 'auto' or 'triton'."
        )
    return choice != "triton" and usable


def takes_prefix_on_flash_attn(impl, dtype: torch.dtype) -> bool:
    """Whether a target layer's steady-state steps will run :func:`flash_prefix_step`
    (for the start-up warm-up; a choice that cannot run fails at the first tree)."""
    choice = getattr(impl, "_ddtree_prefix_choice", None)
    if choice is None:  # not a DDTree CUDA impl
        return False
    try:
        return prefix_on_flash_attn(choice, getattr(impl, "vllm_flash_attn_version", None),
                                    dtype)
    except ValueError:
        return False


class TreeRowsImplMixin:
    """``forward`` of a CUDA attention impl with ancestor-masked verify rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        ddtree = get_ddtree_config(get_current_vllm_config_or_none())
        self._ddtree_prefix_choice = ddtree.prefix_attention if ddtree else "auto"

    def forward(
        self,
        layer,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tree: TreeAttentionInfo | None = getattr(attn_metadata, "tree", None)
        if tree is None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )
        if not getattr(self, "_ddtree_checked", False):
            # Only layers that see trees (the target's) need the tree kernel's features.
            check_tree_support(self, output_scale, output_block_scale)
            fa_version = getattr(self, "vllm_flash_attn_version", None)
            # Steady-state steps run flash_prefix_step wherever FlashAttention 3 can
            # take the prefix ("auto" and "flash_attn" alike). On an H200
            # (bench_gpu_step, Qwen3-8B shape, 1K prompt, async scheduling) it made the
            # step 1.5% faster at batch 1 and 2.3% at batch 32 than the tree kernel
            # alone (results/gpu_step_20261130_05c4c06_b32_prefix.json).
            self._ddtree_flash_prefix = prefix_on_flash_attn(
                self._ddtree_prefix_choice, fa_version, query.dtype)
            if self._ddtree_flash_prefix:
                logger.info_once(
                    "DDTree tree attention: FlashAttention %d over the prefix, the tree "
                    "kernel over the tree keys", fa_version)
            self._ddtree_checked = True
        if not tree.all_rows_are_tree_rows:
            super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )
        with step_phase("ddtree.tree_attention", query.device):
            self._tree_rows_forward(query, kv_cache, attn_metadata, tree, output)
        return output

    def _tree_rows_forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,
        attn_metadata,
        tree: TreeAttentionInfo,
        output: torch.Tensor,
    ) -> None:
        key_cache, value_cache = split_kv_cache(kv_cache)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        if tree.all_rows_are_tree_rows:  # one call over the batch
            num_reqs = tree.num_reqs
            args = (tree, query, key_cache, value_cache,
                    attn_metadata.block_table[:num_reqs],
                    attn_metadata.seq_lens[:num_reqs],
                    attn_metadata.query_start_loc[: num_reqs + 1],
                    tree.packed_mask, self.scale)
            bounds = {"max_query_len": tree.width,
                      "max_seq_len": attn_metadata.max_seq_len, "out": out}
            if self._ddtree_flash_prefix:
                # The builder's FA3 schedule is this call's when it was made for the
                # prefixes of this many requests (under a full CUDA graph both are
                # the captured batch; vLLM pads the metadata to it).
                schedule = (attn_metadata.scheduler_metadata
                            if getattr(attn_metadata, "prefix_scheduled_reqs", -1) == num_reqs
                            else None)
                flash_prefix_step(*args, **bounds, num_splits=attn_metadata.max_num_splits,
                                  fa_version=self.vllm_flash_attn_version,
                                  scheduler_metadata=schedule)
            else:
                tree_attention_step(*args, **bounds)
            return
        reqs = tree.req_index
        out[tree.rows] = tree_attention_triton(
            query[tree.rows], key_cache, value_cache,
            attn_metadata.block_table[reqs],
            attn_metadata.seq_lens[reqs],
            tree.rows_query_start_loc,
            tree.packed_mask[reqs],
            self.scale,
            max_query_len=tree.width,
            max_seq_len=attn_metadata.max_seq_len,
        )


@dataclass
class DDTreeFlashAttentionMetadata(FlashAttentionMetadata):
    tree: TreeAttentionInfo | None = None
    # Requests whose prefixes ``scheduler_metadata`` schedules FlashAttention 3 over
    # (flash_prefix_step's call) instead of the parent's causal call; -1: it does not.
    prefix_scheduled_reqs: int = -1


class DDTreeFlashAttentionMetadataBuilder(
    TreeMetadataBuilderMixin, FlashAttentionMetadataBuilder
):
    """FLASH_ATTN's builder; in a step whose every row is a tree row, the FA3
    schedule it makes ahead (vLLM's ``aot_schedule``) is for the call over the
    prefixes (non-causal, ``seq_lens - query_lens`` keys each), the only
    FlashAttention call such a step makes: the parent's causal kernel never runs."""

    metadata_cls = DDTreeFlashAttentionMetadata
    # Full graphs for uniform verify batches only: a mixed batch's tree rows take
    # the eager path (the parent's kernel, then the tree kernel over its rows).
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self._prefix_scheduled_reqs = -1
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if isinstance(metadata, DDTreeFlashAttentionMetadata):
            metadata.prefix_scheduled_reqs = self._prefix_scheduled_reqs
        return metadata

    def _get_scheduler_metadata(self, *, aot_schedule, batch_size, cu_query_lens,
                                max_query_len, seqlens, max_seq_len, causal,
                                max_num_splits):
        tree = current_tree()
        if aot_schedule and tree is not None and tree.skips_parent_attention:
            # Keys before each request's tree: its seq_len less its query rows (one
            # launch where every request has the same number, steady decoding).
            if tree.uniform_query_len and batch_size == tree.num_reqs:
                seqlens = seqlens - tree.uniform_query_len
            else:
                seqlens = seqlens - cu_query_lens.diff()
            causal = False
            self._prefix_scheduled_reqs = batch_size
        return super()._get_scheduler_metadata(
            aot_schedule=aot_schedule, batch_size=batch_size, cu_query_lens=cu_query_lens,
            max_query_len=max_query_len, seqlens=seqlens, max_seq_len=max_seq_len,
            causal=causal, max_num_splits=max_num_splits,
        )


class DDTreeFlashAttentionImpl(TreeRowsImplMixin, FlashAttentionImpl):
    pass


class DDTreeFlashAttentionBackend(FlashAttentionBackend):
    """FLASH_ATTN plus ancestor-masked verify rows."""

    @staticmethod
    def get_impl_cls() -> type[DDTreeFlashAttentionImpl]:
        return DDTreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeFlashAttentionMetadataBuilder]:
        return DDTreeFlashAttentionMetadataBuilder

    move_kv_slots_layers = staticmethod(move_kv_slots_layers)


# --- TRITON_ATTN --------------------------------------------------------------


@dataclass
class DDTreeTritonAttentionMetadata(TritonAttentionMetadata):
    tree: TreeAttentionInfo | None = None


class DDTreeTritonAttentionMetadataBuilder(
    TreeMetadataBuilderMixin, TritonAttentionMetadataBuilder
):
    metadata_cls = DDTreeTritonAttentionMetadata
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH  # as FLASH_ATTN's above


class DDTreeTritonAttentionImpl(TreeRowsImplMixin, TritonAttentionImpl):
    pass


class DDTreeTritonAttentionBackend(TritonAttentionBackend):
    """TRITON_ATTN plus ancestor-masked verify rows."""

    @staticmethod
    def get_impl_cls() -> type[DDTreeTritonAttentionImpl]:
        return DDTreeTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeTritonAttentionMetadataBuilder]:
        return DDTreeTritonAttentionMetadataBuilder

    move_kv_slots_layers = staticmethod(move_kv_slots_layers)
