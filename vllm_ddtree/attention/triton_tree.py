"""Tree attention for DDTree verify rows in Triton, over vLLM's paged KV cache.

Same signature and semantics as ``tree_attention_reference`` (its torch twin, the test
oracle; see reference.py for the cache layout, the verify rows and the packed mask).
Query ``i`` of request ``r`` sees the whole prefix (positions ``< seq_len - n_r``) and
verify token ``j`` iff bit ``j % 32`` of ``mask[r, i, j // 32]`` is set (``j <= i``
without a mask). Rows past ``query_start_loc[-1]`` come back as zeros.

Kernel design (one program per query tile x KV head x KV split):
- A query tile packs ``TOKENS_PER_TILE`` verify tokens times the ``GROUP`` query heads of
  one KV head into ``BLOCK_M`` rows, so each K/V tile loaded from the cache feeds the
  whole GQA group through one ``tl.dot``.
- Keys ``[0, prefix)`` need no mask: full ``BLOCK_N`` tiles run unmasked, only the last
  partial tile is bounded. Keys ``[prefix, seq_len)`` are the tree: a tile reads the
  mask words of its rows, and a tile no row can see (the upper triangle of a tree whose
  parents precede their children) is skipped before any K/V load.
- Online softmax in float32 with ``exp2``; scale * log2(e) rides in the exp2's FFMA.
- Split-KV (flash-decoding): when requests x KV heads x query tiles cannot fill the SMs
  (batch 1, long prefix), each request's prefix is cut into ``num_splits`` chunks and its
  tree tiles are dealt round-robin; every split writes ``(o / l, m + log2 l)`` in float32
  and ``merge_splits_kernel`` combines them.
- Grid axis 0 is the query tile, so the tiles that read the same K/V run together and
  share it through L2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_ddtree.attention.reference import BITS_PER_WORD, pack_tree_mask

__all__ = [
    "TileConfig",
    "TreeAttentionPlan",
    "choose_num_splits",
    "launch_tree_attention",
    "merge_splits",
    "pick_tile_config",
    "plan_tree_attention",
    "tree_attention_triton",
]

LOG2_E = 1.4426950408889634
MIN_SPLIT_KEYS = 256  # a KV split shorter than this costs more to merge than it saves
MAX_SPLITS = 64
WAVES = 2  # split until about this many programs per SM


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile: verify tokens x query heads of one KV head
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def tree_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor | None,  # [num_reqs, max_q, max_q] bool, or packed int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    config: TileConfig | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton twin of ``tree_attention_reference``; the extra keywords are optional.

    ``max_query_len`` and ``max_seq_len`` are host-side bounds (vLLM's metadata has
    both); given, the call never synchronises and can be captured in a CUDA graph,
    otherwise they are read off the device. ``max_query_len`` sizes the grid, and
    ``max_seq_len`` only the split count (``num_splits`` overrides it). ``out`` is
    written in full, padding rows included. A step's layers share one
    :func:`plan_tree_attention` and call :func:`launch_tree_attention` each.
    """
    plan = plan_tree_attention(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, tree_mask,
        scale, max_query_len=max_query_len, max_seq_len=max_seq_len, num_splits=num_splits,
        out=out, config=config,
    )
    return launch_tree_attention(plan, query, key_cache, value_cache, out)


@dataclass
class TreeAttentionPlan:
    """What a tree-attention call works out from shapes and metadata alone: checked,
    sized and allocated once per step, then launched for every layer (a step's
    layers differ only in their query, caches and output, never in shape)."""

    signature: tuple  # shapes, strides and dtypes the plan was checked for
    num_tokens: int
    num_reqs: int
    num_splits: int
    grid: tuple[int, int, int]
    part_out: torch.Tensor | None  # [num_splits, num_tokens, num_heads, head_dim] float32
    part_lse: torch.Tensor | None  # [num_splits, num_tokens, num_heads] float32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    step_args: tuple  # block table, seq lens, query_start_loc, mask and the scalars after them
    stride_args: tuple  # K, V, block-table and mask strides (query's and out's: per launch)
    constexprs: dict


def plan_signature(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple:
    """What must be equal for two layers to share a plan."""
    return (
        query.shape, query.stride(), query.dtype, query.device,
        key_cache.shape, key_cache.stride(), value_cache.stride(), key_cache.dtype,
        None if out is None else (out.shape, out.stride(), out.dtype),
    )


def plan_tree_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor | None,  # [num_reqs, max_q, max_q] bool, or packed int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    config: TileConfig | None = None,
) -> TreeAttentionPlan:
    """Check the inputs and choose tiles, splits and grid (tree_attention_triton's keywords)."""
    num_reqs = _check_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out
    )
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    mask = _packed_mask(tree_mask, num_reqs)
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max()) if num_reqs else 0
    if mask is not None and max_query_len > mask.shape[1]:
        raise ValueError(
            f"tree_mask covers {mask.shape[1]} verify tokens but a request has "
            f"{max_query_len}: the mask must be sized by budget + 1, not the drafter "
            f"block size"
        )
    signature = plan_signature(query, key_cache, value_cache, out)
    if num_tokens == 0 or num_reqs == 0:  # nothing to launch: empty, or all zeros
        return TreeAttentionPlan(signature, num_tokens, num_reqs, 0, (0, 0, 0), None, None,
                                 query_start_loc, (), (), {})

    group = num_heads // num_kv_heads
    num_sms = _num_sms(query.device)
    config = config or pick_tile_config(
        head_dim, group, query.dtype, max_query_len, num_reqs * num_kv_heads, num_sms
    )
    tokens_per_tile = config.block_m // group
    num_q_tiles = max(1, triton.cdiv(max_query_len, tokens_per_tile))
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        programs = num_reqs * num_kv_heads * num_q_tiles
        num_splits = choose_num_splits(programs, max_seq_len, num_sms)
    part_out = part_lse = None
    if num_splits > 1:
        part_out = torch.empty(
            num_splits, num_tokens, num_heads, head_dim,
            dtype=torch.float32, device=query.device,
        )
        part_lse = torch.empty(
            num_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device
        )
    mask_arg = mask if mask is not None else seq_lens  # unused without a mask
    mask_strides = mask.stride()[:2] if mask is not None else (0, 0)
    return TreeAttentionPlan(
        signature=signature,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_splits=num_splits,
        # The extra request index (num_splits == 1) is the program that zeroes padding rows.
        grid=(num_q_tiles, num_splits * num_kv_heads, num_reqs + (num_splits == 1)),
        part_out=part_out,
        part_lse=part_lse,
        query_start_loc=query_start_loc,
        step_args=(block_table, seq_lens, query_start_loc, mask_arg, scale * LOG2_E,
                   num_reqs, num_tokens, num_splits),
        stride_args=(*key_cache.stride()[:3], *value_cache.stride()[:3],
                     block_table.stride(0), *mask_strides),
        constexprs={
            "NUM_KV_HEADS": num_kv_heads,
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": max(16, triton.next_power_of_2(head_dim)),
            "PAGE_SIZE": key_cache.shape[1],
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "TOKENS_PER_TILE": tokens_per_tile,
            "HAS_MASK": mask is not None,
            "SPLIT": num_splits > 1,
            "DOT_PRECISION": "tf32x3" if query.dtype == torch.float32 else "tf32",
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
        },
    )


def launch_tree_attention(
    plan: TreeAttentionPlan,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], plan's signature
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Run a plan on one layer's tensors; the caller keeps plans by signature, so
    ``plan_signature(query, key_cache, value_cache, out) == plan.signature``."""
    out = torch.empty_like(query) if out is None else out
    if plan.num_tokens == 0:
        return out
    if plan.num_reqs == 0:
        return out.zero_()
    part_out = plan.part_out if plan.part_out is not None else out  # unused without splits
    part_lse = plan.part_lse if plan.part_lse is not None else out
    tree_attention_kernel[plan.grid](
        out, part_out, part_lse, query, key_cache, value_cache, *plan.step_args,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *plan.stride_args, **plan.constexprs,
    )
    if plan.num_splits > 1:
        merge_splits(out, plan.part_out, plan.part_lse, plan.query_start_loc)
    return out


def merge_splits(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    part_out: torch.Tensor,  # [num_splits, num_tokens, num_heads, head_dim] float32
    part_lse: torch.Tensor,  # [num_splits, num_tokens, num_heads] float32, log2 units
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
) -> None:
    """out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max); padding rows = 0."""
    num_splits, num_tokens, num_heads, head_dim = part_out.shape
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    merge_splits_kernel[grid](
        out, part_out, part_lse, query_start_loc,
        query_start_loc.shape[0] - 1, num_tokens, num_splits,
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_H=block_h,
        num_warps=4,
    )


def pick_tile_config(
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    max_query_len: int,
    num_pairs: int = 1 << 20,
    num_sms: int = 132,
) -> TileConfig:
    """Tiles for Hopper, picked from an H200 sweep (benchmarks/README.md);
    ``num_pairs`` = requests x KV heads.

    16-bit, head_dim 128: 128 query rows x 128 keys, 3 stages (fastest on every swept
    shape but one); 64 x 64 with 4 warps when a KV head has <= 128 query rows and at
    most a quarter of the SMs would get one (batch-1 short trees: more, lighter CTAs
    hide latency better); fewer
    rows when a KV head has fewer than 128 query rows (decode-like rows). Head_dim 64:
    128 x 64 (128 keys spill). Head_dim 256: 64 x 32. Float32 (3-pass tf32): small.
    """
    head_dim_pad = triton.next_power_of_2(head_dim)
    rows = max(1, max_query_len * group)
    rows_pow2 = triton.next_power_of_2(rows)
    min_rows = max(16, triton.next_power_of_2(group))  # at least one token per tile
    if dtype == torch.float32:
        block_m = max(min_rows, min(64, rows_pow2))
        return TileConfig(block_m, 32 if head_dim_pad <= 64 else 16, 4, 1)
    if head_dim_pad > 128:
        block_m = max(min_rows, min(64, rows_pow2))
        return TileConfig(block_m, 32, 8 if block_m >= 64 else 4, 2)
    if rows <= 128 and num_pairs <= num_sms // 4:
        return TileConfig(max(min_rows, min(64, rows_pow2)), 64, 4, 3)
    block_m = max(min_rows, min(128, rows_pow2))
    if block_m < 128:
        return TileConfig(block_m, 64, 4, 3)
    return TileConfig(block_m, 128 if head_dim_pad == 128 else 64, 8, 3)


def choose_num_splits(programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split the keys until about WAVES programs per SM, keeping >= MIN_SPLIT_KEYS each."""
    if programs >= num_sms:
        return 1
    want = triton.cdiv(WAVES * num_sms, programs)
    return max(1, min(want, max_seq_len // MIN_SPLIT_KEYS, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs on the CPU: plan as for an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def _packed_mask(
    tree_mask: torch.Tensor | None, num_reqs: int
) -> torch.Tensor | None:  # [num_reqs, max_q, num_words] int32
    if tree_mask is None:
        return None
    if tree_mask.dtype == torch.bool:
        if tree_mask.dim() != 3 or tree_mask.shape[1] != tree_mask.shape[2]:
            raise ValueError(
                f"a bool tree_mask must be [num_reqs, max_q, max_q], got "
                f"{tuple(tree_mask.shape)}"
            )
        tree_mask = pack_tree_mask(tree_mask)
    if tree_mask.dtype != torch.int32 or tree_mask.dim() != 3:
        raise ValueError(
            f"tree_mask must be bool [num_reqs, max_q, max_q] or packed int32 "
            f"[num_reqs, max_q, num_words], got {tree_mask.dtype} "
            f"{tuple(tree_mask.shape)}"
        )
    num_words = -(-tree_mask.shape[1] // BITS_PER_WORD)
    if tree_mask.shape[0] != num_reqs or tree_mask.shape[2] < num_words:
        raise ValueError(
            f"packed tree_mask must be [num_reqs={num_reqs}, max_q, >= ceil(max_q / 32)], "
            f"got {tuple(tree_mask.shape)}"
        )
    if tree_mask.stride(2) != 1:
        tree_mask = tree_mask.contiguous()
    return tree_mask


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
) -> int:
    """Shape, dtype and device checks that need no device sync; returns num_reqs."""
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"expected query [num_tokens, num_heads, head_dim] and equal caches "
            f"[num_blocks, block_size, num_kv_heads, head_dim], got query "
            f"{tuple(query.shape)}, key_cache {tuple(key_cache.shape)}, "
            f"value_cache {tuple(value_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = key_cache.shape[2:]
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads of dim {head_dim}, cache has {num_kv_heads} "
            f"KV heads of dim {cache_head_dim}: need equal dims and num_heads a "
            f"multiple of num_kv_heads"
        )
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (
        query.dtype == key_cache.dtype == value_cache.dtype
    ):
        raise ValueError(
            f"query, key_cache and value_cache must share one of float16, bfloat16, "
            f"float32; got {query.dtype}, {key_cache.dtype}, {value_cache.dtype}"
        )
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query and the caches need a contiguous head_dim (stride 1)")
    num_reqs = seq_lens.shape[0]
    metadata = (block_table, seq_lens, query_start_loc)
    if (
        query_start_loc.shape != (num_reqs + 1,)
        or block_table.dim() != 2
        or block_table.shape[0] != num_reqs
        or any(t.dtype != torch.int32 for t in metadata)
    ):
        raise ValueError(
            f"{num_reqs} requests need int32 query_start_loc ({num_reqs + 1},) and "
            f"int32 block_table ({num_reqs}, max_blocks); got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}, "
            f"{block_table.dtype} {tuple(block_table.shape)}, seq_lens {seq_lens.dtype}"
        )
    if block_table.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("block_table rows and seq_lens must be contiguous")
    if not query_start_loc.is_contiguous():
        raise ValueError("query_start_loc must be contiguous")
    if out is not None and (
        out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1
    ):
        raise ValueError(
            f"out must match query {tuple(query.shape)} {query.dtype} with a "
            f"contiguous head_dim, got {tuple(out.shape)} {out.dtype}"
        )
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if query.device.type != "cuda" and not interpret:
        raise ValueError(
            f"tree_attention_triton needs CUDA tensors, got {query.device}; use "
            f"tree_attention_reference on the CPU"
        )
    return num_reqs


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit(
    do_not_specialize=[
        "num_reqs",
        "num_tokens",
        "num_splits",
        "block_table_stride",
        "mask_stride_r",
        "mask_stride_q",
    ]
)
def tree_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_splits, num_tokens, num_heads, head_dim] float32 (SPLIT)
    part_lse_ptr,  # [num_splits, num_tokens, num_heads] float32 (SPLIT)
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, page_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    mask_ptr,  # [num_reqs, max_q, num_words] int32 (HAS_MASK)
    qk_scale,  # softmax scale * log2(e)
    num_reqs,
    num_tokens,
    num_splits,
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    k_stride_b,
    k_stride_s,
    k_stride_h,
    v_stride_b,
    v_stride_s,
    v_stride_h,
    block_table_stride,
    mask_stride_r,
    mask_stride_q,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP
    HAS_MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1) % NUM_KV_HEADS
    split = tl.program_id(1) // NUM_KV_HEADS
    req = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)  # row = token * GROUP + head in group
    head = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    row_in_tile = rows < TOKENS_PER_TILE * GROUP

    if req >= num_reqs:  # padding rows past query_start_loc[-1] (only without SPLIT)
        first = tl.load(query_start_loc_ptr + num_reqs)
        zeros = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty)
        step = tl.num_programs(0) * TOKENS_PER_TILE
        for tok0 in range(first + pid_q * TOKENS_PER_TILE, num_tokens, step):
            tok = tok0 + rows // GROUP
            ok = row_in_tile & (tok < num_tokens)
            ptrs = (
                out_ptr
                + tok.to(tl.int64)[:, None] * out_stride_t
                + head[:, None] * out_stride_h
                + offs_d[None, :]
            )
            tl.store(ptrs, zeros, mask=ok[:, None] & d_ok[None, :])
        return

    q_start = tl.load(query_start_loc_ptr + req)
    num_queries = tl.load(query_start_loc_ptr + req + 1) - q_start
    if pid_q * TOKENS_PER_TILE >= num_queries:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - num_queries
    qi = pid_q * TOKENS_PER_TILE + rows // GROUP  # verify token of each row
    row_ok = row_in_tile & (qi < num_queries)
    token = (q_start + qi).to(tl.int64)

    q = tl.load(
        query_ptr
        + token[:, None] * query_stride_t
        + head[:, None] * query_stride_h
        + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: masked rows stay NaN-free
    block_table_row = block_table_ptr + req.to(tl.int64) * block_table_stride

    # Prefix: this split's chunk of [0, prefix_len), unmasked full tiles + one tail.
    chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
    p_lo = split * chunk
    p_hi = tl.minimum(p_lo + chunk, prefix_len)
    full_hi = p_lo + tl.maximum(p_hi - p_lo, 0) // BLOCK_N * BLOCK_N
    no_mask = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int1)
    for start in range(p_lo, full_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, keys, keys < p_hi, no_mask, kv_head, qk_scale,
            key_cache_ptr, value_cache_ptr, block_table_row,
            k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
            offs_d, d_ok,
            HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, False, False, DOT_PRECISION,
        )
    if full_hi < p_hi:
        keys = full_hi + tl.arange(0, BLOCK_N)
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, keys, keys < p_hi, no_mask, kv_head, qk_scale,
            key_cache_ptr, value_cache_ptr, block_table_row,
            k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
            offs_d, d_ok,
            HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, True, False, DOT_PRECISION,
        )

    # Tree: verify tokens j = 0 .. num_queries - 1, tiles dealt round-robin to splits.
    request_mask = mask_ptr + req.to(tl.int64) * mask_stride_r
    for tile in range(split, tl.cdiv(num_queries, BLOCK_N), num_splits):
        j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < num_queries
        both_ok = row_ok[:, None] & j_ok[None, :]
        if HAS_MASK:
            words = tl.load(
                request_mask + qi[:, None] * mask_stride_q + (j[None, :] >> 5),
                mask=both_ok,
                other=0,
            )
            visible = both_ok & (((words >> (j[None, :] & 31)) & 1) != 0)
        else:
            visible = both_ok & (j[None, :] <= qi[:, None])
        if tl.sum(tl.sum(visible.to(tl.int32), 1), 0) > 0:
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, prefix_len + j, j_ok, visible, kv_head, qk_scale,
                key_cache_ptr, value_cache_ptr, block_table_row,
            k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
            offs_d, d_ok,
                HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, True, True, DOT_PRECISION,
            )

    store_ok = row_ok[:, None] & d_ok[None, :]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:
        part_row = (split * num_tokens + token) * (NUM_KV_HEADS * GROUP) + head
        tl.store(
            part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=store_ok
        )
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
    else:
        tl.store(
            out_ptr
            + token[:, None] * out_stride_t
            + head[:, None] * out_stride_h
            + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=store_ok,
        )


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] float32
    l_i,  # [BLOCK_M] float32
    m_i,  # [BLOCK_M] float32, log2 units
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    keys,  # [BLOCK_N] positions in the request
    key_ok,  # [BLOCK_N] (MASK_KEYS)
    visible,  # [BLOCK_M, BLOCK_N] (USE_VISIBLE)
    kv_head,
    qk_scale,
    key_cache_ptr,
    value_cache_ptr,
    block_table_row,  # [max_blocks_per_req] int32, this request's row
    k_stride_b,
    k_stride_s,
    k_stride_h,
    v_stride_b,
    v_stride_s,
    v_stride_h,
    offs_d,  # [HEAD_DIM_PAD]
    d_ok,  # [HEAD_DIM_PAD]
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    USE_VISIBLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a tile of keys: s = q k^T, rescale, acc += p v."""
    if MASK_KEYS:
        block = tl.load(block_table_row + keys // PAGE_SIZE, mask=key_ok, other=0)
    else:
        block = tl.load(block_table_row + keys // PAGE_SIZE)
    block = block.to(tl.int64)
    offset = keys % PAGE_SIZE
    k_rows = block * k_stride_b + offset * k_stride_s + kv_head * k_stride_h  # [BLOCK_N]
    v_rows = block * v_stride_b + offset * v_stride_s + kv_head * v_stride_h
    k_ptrs = key_cache_ptr + k_rows[None, :] + offs_d[:, None]  # [HEAD_DIM_PAD, BLOCK_N]
    v_ptrs = value_cache_ptr + v_rows[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
    if MASK_KEYS:
        k = tl.load(k_ptrs, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    elif HEAD_DIM != HEAD_DIM_PAD:
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)

    s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if USE_VISIBLE:
        s = tl.where(visible, s, float("-inf"))
    elif MASK_KEYS:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    # The scale rides in the exp2's FFMA; qk_scale > 0 keeps the row max the max.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_splits"])
def merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_splits, num_tokens, num_heads, head_dim] float32
    part_lse_ptr,  # [num_splits, num_tokens, num_heads] float32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,
    num_tokens,
    num_splits,
    out_stride_t,
    out_stride_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = heads < NUM_HEADS
    both_ok = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    out_ptrs = (
        out_ptr
        + token.to(tl.int64) * out_stride_t
        + heads[:, None] * out_stride_h
        + offs_d[None, :]
    )
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # padding row
        zeros = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptrs, zeros, mask=both_ok)
        return

    row = token.to(tl.int64) * NUM_HEADS + heads  # [BLOCK_H] row of split 0
    split_rows = num_tokens.to(tl.int64) * NUM_HEADS
    lse_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        lse = tl.load(part_lse_ptr + s * split_rows + row, mask=h_ok, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in range(num_splits):
        lse = tl.load(part_lse_ptr + s * split_rows + row, mask=h_ok, other=float("-inf"))
        weight = tl.exp2(lse - lse_max)
        part = tl.load(
            part_out_ptr + (s * split_rows + row)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=both_ok,
            other=0.0,
        )
        acc += weight[:, None] * part
        weight_sum += weight
    weight_sum = tl.where(weight_sum == 0.0, 1.0, weight_sum)
    out = acc / weight_sum[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=both_ok)
