"""Tree attention for DDTree verify rows in Triton, over vLLM's paged KV cache.

Same signature and semantics as ``tree_attention_reference`` (its torch twin, the test
oracle; see ops/attention_reference.py for the cache layout, the verify rows and the packed mask).
Query ``i`` of request ``r`` sees the whole prefix (positions ``< seq_len - n_r``) and
verify token ``j`` iff bit ``j % 32`` of ``mask[r, i, j // 32]`` is set (``j <= i``
without a mask). Rows past ``query_start_loc[-1]`` come back as zeros.

Kernel design (one program per query tile x KV head x KV split):
- A query tile packs ``TOKENS_PER_TILE`` verify tokens times the ``GROUP`` query heads of
  one KV head into ``BLOCK_M`` rows, so each K/V tile loaded from the cache feeds the
  whole GQA group through one ``tl.dot``.
- Keys ``[0, prefix)`` need no mask: full ``BLOCK_N`` tiles run unmasked, only the last
  partial tile is bounded. Keys ``[prefix, seq_len)`` are the tree: a tile no row can
  see (the upper triangle of a tree whose parents precede their children, and most of
  the rest, as a row sees only its ancestors) is skipped before any K/V load. With key
  tiles of at most 32 keys (the prefix-given tiles) a program walks instead the list of
  tree keys its rows see (tile_keys.py, made with the plan), ``BLOCK_N`` at a
  time: fewer steps, as a tile's rows share few keys, spread over the tree.
- Online softmax in float32 with ``exp2``; scale * log2(e) rides in the exp2's FFMA.
- Split-KV (flash-decoding): when requests x KV heads x query tiles cannot fill the SMs
  (batch 1, long prefix), each request's prefix is cut into ``num_splits`` chunks and its
  tree tiles are dealt round-robin; every split writes ``(o / l, m + log2 l)`` in float32
  and ``merge_splits_kernel`` (merge_splits.py) combines them.
- Grid axis 0 is the query tile, so the tiles that read the same K/V run together and
  share it through L2.
- Prefix given (``prefix_lse``): another kernel (FlashAttention 3 on Hopper, whose
  prefix pass is faster than this kernel's) has already written each verify row's
  attention over the prefix alone into ``out``, with its natural-log LSE. The kernel
  then starts its online softmax from that partial result (``m = lse * log2 e``,
  ``l = 1``, ``acc = o``) and attends to the tree keys only (at most budget + 1):
  one more launch, and the prefix runs at FlashAttention's speed. With at most
  budget + 1 keys left, its tiles are small (pick_prefix_given_config).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.merge_splits import merge_splits
from vllm_ddtree.kernels.tree_attention_plan import (
    TileConfig,
    TreeAttentionPlan,
    choose_num_splits,
    pick_tile_config,
    plan_signature,
    plan_tree_attention,
)

__all__ = [
    "TileConfig",
    "TreeAttentionPlan",
    "choose_num_splits",
    "launch_tree_attention",
    "pick_tile_config",
    "plan_signature",
    "plan_tree_attention",
    "tree_attention_triton",
]


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
    prefix_lse: torch.Tensor | None = None,  # [num_heads, >= num_tokens] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton twin of ``tree_attention_reference``; the extra keywords are optional.

    ``max_query_len`` and ``max_seq_len`` are host-side bounds (vLLM's metadata has
    both); given, the call never synchronises and can be captured in a CUDA graph,
    otherwise they are read off the device. ``max_query_len`` sizes the grid, and
    ``max_seq_len`` only the split count (``num_splits`` overrides it). ``out`` is
    written in full, padding rows included. A step's layers share one
    :func:`plan_tree_attention` and call :func:`launch_tree_attention` each.

    With ``prefix_lse``, ``out`` must already hold every verify row's attention over
    its prefix alone (keys ``< seq_len - n_r``) and ``prefix_lse`` that attention's
    natural-log LSE, FlashAttention's ``softmax_lse`` (``prefix_attention_reference``
    is its torch twin; +-inf marks a row without prefix keys): the kernel adds the
    tree keys to it in place.
    """
    plan = plan_tree_attention(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, tree_mask,
        scale, max_query_len=max_query_len, max_seq_len=max_seq_len, num_splits=num_splits,
        out=out, config=config, prefix_given=prefix_lse is not None,
    )
    return launch_tree_attention(plan, query, key_cache, value_cache, out, prefix_lse)


def launch_tree_attention(
    plan: TreeAttentionPlan,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], plan's signature
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor | None = None,
    prefix_lse: torch.Tensor | None = None,  # [num_heads, >= num_tokens] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Run a plan on one layer's tensors; the caller keeps plans by signature, so
    ``plan_signature(query, key_cache, value_cache, out) == plan.signature``. A plan
    made with ``prefix_given`` takes the layer's ``prefix_lse`` and ``out`` holding
    the prefix's attention (tree_attention_triton)."""
    if plan.prefix_given != (prefix_lse is not None):
        raise ValueError(
            "a plan made with prefix_given needs the layer's prefix_lse (and out holding "
            "the prefix's attention); a plan without it takes none"
        )
    if out is None:
        if prefix_lse is not None:
            raise ValueError("prefix_lse needs out, which holds the prefix's attention")
        out = torch.empty_like(query)
    if plan.num_tokens == 0:
        return out
    if plan.num_reqs == 0:
        return out.zero_()
    part_out = plan.part_out if plan.part_out is not None else out  # unused without splits
    part_lse = plan.part_lse if plan.part_lse is not None else out
    if prefix_lse is not None:
        _check_prefix_lse(prefix_lse, query)
    lse = prefix_lse if prefix_lse is not None else out  # unused without the prefix given
    lse_strides = prefix_lse.stride() if prefix_lse is not None else (0, 0)
    tree_attention_kernel[plan.grid](
        out, part_out, part_lse, lse, query, key_cache, value_cache, *plan.step_args,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *lse_strides,
        *plan.stride_args, **plan.constexprs,
    )
    if plan.num_splits > 1:
        merge_splits(out, plan.part_out, plan.part_lse, plan.query_start_loc)
    return out


def _check_prefix_lse(
    prefix_lse: torch.Tensor,  # [num_heads, >= num_tokens] float32
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    if (
        prefix_lse.dtype != torch.float32
        or prefix_lse.dim() != 2
        or prefix_lse.shape[0] != query.shape[1]
        or prefix_lse.shape[1] < query.shape[0]
        or prefix_lse.device != query.device
    ):
        raise ValueError(
            f"prefix_lse must be float32 [num_heads={query.shape[1]}, >= num_tokens="
            f"{query.shape[0]}] on {query.device} (FlashAttention's softmax_lse), got "
            f"{prefix_lse.dtype} {tuple(prefix_lse.shape)} on {prefix_lse.device}"
        )


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
        "lse_stride_h",  # FlashAttention's LSE is [num_heads, num_tokens]: batch-dependent
    ],
    # Per-request metadata: read one value at a time, so alignment buys nothing, and a
    # slice of it starting mid-buffer would otherwise compile a second variant.
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr"],
)
def tree_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_splits, num_tokens, num_heads, head_dim] float32 (SPLIT)
    part_lse_ptr,  # [num_splits, num_tokens, num_heads] float32 (SPLIT)
    prefix_lse_ptr,  # [num_heads, >= num_tokens] float32, natural log (PREFIX_GIVEN)
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, page_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    mask_ptr,  # [num_reqs, max_q, num_words] int32 (HAS_MASK)
    tile_keys_ptr,  # [num_reqs, num_q_tiles, key row] int16 (KEY_LISTS)
    tile_key_counts_ptr,  # [num_reqs, num_q_tiles] int32 (KEY_LISTS)
    qk_scale,  # softmax scale * log2(e)
    num_reqs,
    num_tokens,
    num_splits,
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    lse_stride_h,
    lse_stride_t,
    k_stride_b,
    k_stride_s,
    k_stride_h,
    v_stride_b,
    v_stride_s,
    v_stride_h,
    block_table_stride,
    mask_stride_r,
    mask_stride_q,
    tile_keys_stride,  # a tile's key list row (KEY_LISTS)
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
    PREFIX_GIVEN: tl.constexpr,  # out holds the prefix's attention, its LSE given
    KEY_LISTS: tl.constexpr,  # walk the tile's listed tree keys, not the key tiles
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
    # Never below 0, so no key position is: a request with fewer keys than rows is no
    # real step's, but a capture's dummy batch can be one (vLLM's Triton builder
    # captures with seq_lens of 1; TreeMetadataBuilderMixin raises them).
    prefix_len = tl.maximum(seq_len - num_queries, 0)
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
    block_table_row = block_table_ptr + req.to(tl.int64) * block_table_stride
    out_ptrs = (
        out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + offs_d[None, :]
    )
    if PREFIX_GIVEN:
        # Resume from the prefix's softmax: sum_k 2^(s_k) = 2^m with l = 1, acc = o.
        lse = tl.load(
            prefix_lse_ptr + head * lse_stride_h + token * lse_stride_t,
            mask=row_ok,
            other=float("inf"),
        )
        has_prefix = (lse != float("inf")) & (lse != float("-inf"))  # FA: +inf if empty
        m_i = tl.where(has_prefix, lse * 1.4426950408889634, -1.0e30)
        l_i = tl.where(has_prefix, 1.0, 0.0)
        o_prefix = tl.load(out_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.where(has_prefix[:, None], o_prefix.to(tl.float32), 0.0)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: masked rows stay NaN-free

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
    if KEY_LISTS:
        # The keys some row of this tile sees, in increasing order (list_tile_keys,
        # once per step): chunks of them, not the tree's key tiles, most of whose
        # keys no row of the tile sees.
        tile_row = req * tl.num_programs(0) + pid_q
        num_seen = tl.load(tile_key_counts_ptr + tile_row)
        tile_keys = tile_keys_ptr + tile_row.to(tl.int64) * tile_keys_stride
        slot = tl.arange(0, BLOCK_N)
        for chunk in range(split, tl.cdiv(num_seen, BLOCK_N), num_splits):
            j_ok = chunk * BLOCK_N + slot < num_seen
            j = tl.load(tile_keys + chunk * BLOCK_N + slot, mask=j_ok, other=0).to(tl.int32)
            visible = _visible(request_mask, mask_stride_q, qi, j, row_ok[:, None] & j_ok[None, :])
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, prefix_len + j, j_ok, visible, kv_head, qk_scale,
                key_cache_ptr, value_cache_ptr, block_table_row,
                k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
                offs_d, d_ok,
                HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, True, True, DOT_PRECISION,
            )
    else:
        for tile in range(split, tl.cdiv(num_queries, BLOCK_N), num_splits):
            j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            j_ok = j < num_queries
            both_ok = row_ok[:, None] & j_ok[None, :]
            if HAS_MASK:
                visible = _visible(request_mask, mask_stride_q, qi, j, both_ok)
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
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=store_ok)


@triton.jit
def _visible(
    request_mask,  # [max_q, num_words] int32, this request's packed mask
    mask_stride_q,
    qi,  # [BLOCK_M] verify token of each row
    j,  # [BLOCK_N] verify token of each key
    both_ok,  # [BLOCK_M, BLOCK_N] row and key in range
):
    """[BLOCK_M, BLOCK_N]: row qi sees key j (bit j % 32 of its word j // 32)."""
    words = tl.load(
        request_mask + qi[:, None] * mask_stride_q + (j[None, :] >> 5), mask=both_ok, other=0
    )
    return both_ok & (((words >> (j[None, :] & 31)) & 1) != 0)


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
