"""The merge of split-KV tree attention: each split's partial softmax, combined by LSE.

When one request's keys are cut into ``num_splits`` chunks (flash-decoding), every split
writes ``(o / l, m + log2 l)`` in float32 (tree_attention.py); this launch combines them
into the output, one program per token and block of heads. Padding rows come back as
zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_splits", "merge_splits_kernel"]


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
