"""The tree keys of the verify rows, gathered per row from its ancestors (Triton).

With the prefix given (FlashAttention 3 has attended each verify row to its prefix and
left the result in ``out`` with its LSE; triton_tree.py's module docstring), what is
left of tree attention is each row's own ancestors: at most the drafter's block size
of keys (a tree's depth is below it), out of budget + 1. The tiled tree kernel visits
every tile of tree keys some row of the tile can see, which for a wide tree is most of
them; this kernel visits only the keys each row sees.

One program per (tile of ``TOKENS`` verify tokens, KV head, request):
- The tile's ancestor masks are read once ([TOKENS, words] int32) and their set bits
  are taken lowest first, ``SLOTS`` per round: each round gives every token a list of
  ``SLOTS`` key positions (-1 where it has run out), and rounds go on while any bit is
  left, so any number of visible keys is served.
- A round gathers the listed keys' K and V from the paged cache as [TOKENS, SLOTS,
  head_dim] and attends every query head of the KV head (padded to 16 rows, the least
  a dot takes) through batched dots: [TOKENS, heads, head_dim] x [TOKENS, head_dim,
  SLOTS], then the probabilities x [TOKENS, SLOTS, head_dim].
- The online softmax resumes from the prefix's result (``m = lse * log2 e``, ``l = 1``,
  ``acc = o``), as the tiled kernel's prefix-given path does.

The bit position of a word's lowest set bit is read off the exponent of the bit's
value as a float32 (a power of two, exact), which needs no bit-count intrinsic.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ancestor_attention_kernel"]


@triton.jit(
    do_not_specialize=[
        "num_reqs",
        "num_tokens",
        "block_table_stride",
        "mask_stride_r",
        "mask_stride_q",
        "lse_stride_h",
    ],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr"],
)
def ancestor_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], holding the prefix's attention
    prefix_lse_ptr,  # [num_heads, >= num_tokens] float32, natural log
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, page_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32, verify tokens included
    query_start_loc_ptr,  # [num_reqs + 1] int32
    mask_ptr,  # [num_reqs, max_q, >= WORDS] int32, packed ancestor masks
    qk_scale,  # softmax scale * log2(e)
    num_reqs,
    num_tokens,
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
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16, a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,  # verify tokens per program
    SLOTS: tl.constexpr,  # keys per token and round, >= 16
    WORDS: tl.constexpr,  # mask words per row, ceil(max_q / 32)
    WORDS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.program_id(2)
    t = tl.arange(0, TOKENS)
    g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * GROUP + g  # [GROUP_PAD]
    g_ok = g < GROUP
    d_ok = offs_d < HEAD_DIM
    hd_ok = g_ok[None, :, None] & d_ok[None, None, :]  # [1, GROUP_PAD, HEAD_DIM_PAD]
    head_d = head[None, :, None]

    if req >= num_reqs:  # padding rows past query_start_loc[-1]: zeros
        first = tl.load(query_start_loc_ptr + num_reqs)
        zeros = tl.zeros([TOKENS, GROUP_PAD, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty)
        step = tl.num_programs(0) * TOKENS
        for tok0 in range(first + pid_q * TOKENS, num_tokens, step):
            tok = (tok0 + t).to(tl.int64)
            ptrs = out_ptr + tok[:, None, None] * out_stride_t + head_d * out_stride_h
            ptrs = ptrs + offs_d[None, None, :]
            tl.store(ptrs, zeros, mask=(tok < num_tokens)[:, None, None] & hd_ok)
        return

    q_start = tl.load(query_start_loc_ptr + req)
    num_queries = tl.load(query_start_loc_ptr + req + 1) - q_start
    if pid_q * TOKENS >= num_queries:
        return
    prefix_len = tl.load(seq_lens_ptr + req) - num_queries
    qi = pid_q * TOKENS + t  # [TOKENS] verify token of the request
    t_ok = qi < num_queries
    token = (q_start + qi).to(tl.int64)
    io_ok = t_ok[:, None, None] & hd_ok  # [TOKENS, GROUP_PAD, HEAD_DIM_PAD]

    q = tl.load(
        query_ptr + token[:, None, None] * query_stride_t + head_d * query_stride_h
        + offs_d[None, None, :],
        mask=io_ok,
        other=0.0,
    )
    out_ptrs = (
        out_ptr + token[:, None, None] * out_stride_t + head_d * out_stride_h
        + offs_d[None, None, :]
    )
    # Resume from the prefix's softmax: sum_k 2^(s_k) = 2^m with l = 1, acc = o.
    row_ok = t_ok[:, None] & g_ok[None, :]  # [TOKENS, GROUP_PAD]
    lse = tl.load(
        prefix_lse_ptr + head[None, :] * lse_stride_h + token[:, None] * lse_stride_t,
        mask=row_ok,
        other=float("inf"),
    )
    has_prefix = (lse != float("inf")) & (lse != float("-inf"))  # FA: +inf if empty
    m_i = tl.where(has_prefix, lse * 1.4426950408889634, -1.0e30)
    l_i = tl.where(has_prefix, 1.0, 0.0)
    o_prefix = tl.load(out_ptrs, mask=io_ok, other=0.0)
    acc = tl.where(has_prefix[:, :, None], o_prefix.to(tl.float32), 0.0)

    # The tile's masks, bits of keys past the request's verify tokens cleared.
    w = tl.arange(0, WORDS_PAD)
    words = tl.load(
        mask_ptr + req.to(tl.int64) * mask_stride_r + qi[:, None] * mask_stride_q + w[None, :],
        mask=t_ok[:, None] & (w < WORDS)[None, :],
        other=0,
    )
    bits_in_word = tl.minimum(tl.maximum(num_queries - w * 32, 0), 32).to(tl.int64)
    valid_bits = ((tl.full([WORDS_PAD], 1, tl.int64) << bits_in_word) - 1).to(tl.int32)
    words = words & valid_bits[None, :]

    slot = tl.arange(0, SLOTS)
    block_table_row = block_table_ptr + req.to(tl.int64) * block_table_stride
    while tl.sum(tl.sum((words != 0).to(tl.int32), 1), 0) > 0:
        keys = tl.full([TOKENS, SLOTS], -1, dtype=tl.int32)  # verify token of each slot
        for a in tl.static_range(SLOTS):
            first_word = tl.min(tl.where(words != 0, w[None, :], WORDS_PAD), 1)  # [TOKENS]
            in_first = w[None, :] == first_word[:, None]
            word = tl.sum(tl.where(in_first, words, 0), 1)
            low = word & (0 - word)  # the lowest set bit alone
            value = (low.to(tl.int64) & 0xFFFFFFFF).to(tl.float32)  # 2^bit, exact
            bit = ((value.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            found = first_word < WORDS_PAD
            keys = tl.where((slot[None, :] == a) & found[:, None],
                            (first_word * 32 + bit)[:, None], keys)
            words = tl.where(in_first, words & (words - 1), words)
        key_ok = keys >= 0
        position = prefix_len + keys
        block = tl.load(block_table_row + position // PAGE_SIZE, mask=key_ok, other=0)
        block = block.to(tl.int64)
        offset = position % PAGE_SIZE
        k_rows = block * k_stride_b + offset * k_stride_s + kv_head * k_stride_h  # [T, S]
        v_rows = block * v_stride_b + offset * v_stride_s + kv_head * v_stride_h
        k = tl.load(  # [TOKENS, HEAD_DIM_PAD, SLOTS]
            key_cache_ptr + k_rows[:, None, :] + offs_d[None, :, None],
            mask=key_ok[:, None, :] & d_ok[None, :, None],
            other=0.0,
        )
        v = tl.load(  # [TOKENS, SLOTS, HEAD_DIM_PAD]
            value_cache_ptr + v_rows[:, :, None] + offs_d[None, None, :],
            mask=key_ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [TOKENS, GROUP_PAD, SLOTS]
        s = tl.where(key_ok[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, :, None]
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_ok)
