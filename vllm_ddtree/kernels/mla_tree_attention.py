"""Tree attention for MLA verify rows in Triton, over the latent cache.

Each verify row's absorbed MLA attention over its request's prefix and its tree
ancestors among the verify keys (``keys="all"``), or over the ancestors alone
(``keys="tree"``). With ``keys="all"`` the prefix is either attended here or given:
another kernel (a backend's decode pass, non-causal over the prefix, with its LSE)
has already written it, and this kernel resumes that softmax over the tree keys.
Without a mask the verify block is causal (a chain, or decode rows without a tree).
Its torch twin is ``ops/mla_attention.mla_tree_attention``; the cache layout, the
absorbed queries, the verify rows and the mask mean what they mean there.

Kernel design (one program per verify row x block of heads):
- MLA is MQA over one latent row per key, shared by all heads: a program holds
  ``BLOCK_H`` heads' queries (``kv_lora_rank`` + ``rope_dim`` wide) and each key tile
  it loads feeds all of them through one ``tl.dot``; the latent ``kv_c`` is the key's
  no-rope part and the value both.
- Prefix keys (``keys="all"``, no prefix given) are all seen, ``BLOCK_N`` at a time;
  then the request's verify tokens (at most budget + 1), a key seen iff its bit in the
  row's packed ancestor mask is set (``j <= i`` without a mask).
- Split-KV (flash-decoding) when rows x head blocks cannot fill the SMs and the prefix
  is long (``max_seq_len``): grid axis 2 cuts each row's prefix into ``num_splits``
  chunks, the last split also takes the tree keys, and every split writes
  ``(o / l, lse in log2 units)`` in float32 for ``merge_splits`` (merge_splits.py).
  The chunks are cut from each request's own prefix length on the device, so any
  split count is exact: a CUDA graph captured at one count replays correctly.
- Prefix given: the softmax starts from the prefix's output and natural-log LSE
  (``m = lse``, ``l = 1``, ``acc = out``); an LSE of +inf (no prefix keys) starts it
  empty. Softmax in float32.
- Rows past ``query_start_loc[-1]`` (padding) are left as they are: zeros and +inf
  when the kernel allocates the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.device import require_triton_device
from vllm_ddtree.kernels.merge_splits import merge_splits
from vllm_ddtree.kernels.tree_attention_plan import sm_count
from vllm_ddtree.tensors import pack_tree_mask

__all__ = ["mla_tree_attention_triton"]

# The tiling: keys per tile, and the programs per SM that split-KV aims at.
BLOCK_N, WAVES = 32, 8


def mla_tree_attention_triton(
    q_nope: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank], W_UK absorbed
    q_pe: torch.Tensor,  # [num_tokens, num_heads, rope_dim], rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor | None,  # [num_reqs, max_q, max_q] bool, or packed int32
    scale: float,
    keys: str = "all",  # "all": prefix and ancestors; "tree": ancestors alone
    prefix_out: torch.Tensor | None = None,  # [num_tokens, num_heads, kv_lora_rank]
    prefix_lse: torch.Tensor | None = None,  # [num_heads, >= num_tokens] float32
    max_seq_len: int | None = None,  # bound on seq_lens: sizes the KV splits
    *,
    block_n: int = BLOCK_N,  # keys per tile
    waves: int = WAVES,  # split-KV aims at this many programs per SM
) -> tuple[torch.Tensor, torch.Tensor]:  # out like q_nope, lse [num_heads, num_tokens]
    """Each verify row's latent attention (module docstring). With ``prefix_out`` and
    ``prefix_lse`` (``keys="all"`` only) the prefix's attention is resumed, not
    recomputed, and the result is written into them, which are returned. ``block_n``
    and ``waves`` tune the tiling (benchmarks/bench_mla_attention.py --variants)."""
    require_triton_device(q_nope, "mla_tree_attention_triton", "mla_tree_attention")
    check_tiling(block_n, waves)
    num_tokens, num_heads, rank = q_nope.shape
    rope = q_pe.shape[-1]
    if kv_cache.shape[-1] != rank + rope or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(
            f"expected q_nope [num_tokens, num_heads, kv_lora_rank], q_pe [num_tokens, "
            f"num_heads, rope_dim] and kv_cache [..., kv_lora_rank + rope_dim], got "
            f"{tuple(q_nope.shape)}, {tuple(q_pe.shape)} and {tuple(kv_cache.shape)}"
        )
    if (prefix_out is None) != (prefix_lse is None):
        raise ValueError("give both prefix_out and prefix_lse, or neither")
    if keys not in ("all", "tree") or (keys == "tree" and prefix_out is not None):
        raise ValueError(f"keys={keys!r}: expected 'all' (a prefix result may be given) "
                         "or 'tree' (none)")
    num_reqs = seq_lens.shape[0]
    if tree_mask is not None and tree_mask.dtype == torch.bool:
        tree_mask = pack_tree_mask(tree_mask)
    if prefix_out is None:
        out = torch.zeros_like(q_nope)
        lse = torch.full((num_heads, num_tokens), float("inf"), dtype=torch.float32,
                         device=q_nope.device)
    else:
        out, lse = prefix_out, prefix_lse
    # The request of each row (num_reqs for padding rows), found on the device.
    rows = torch.arange(num_tokens, device=q_nope.device, dtype=query_start_loc.dtype)
    token_req = torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True)
    mask = tree_mask if tree_mask is not None else token_req  # unread without a mask
    block_h = 16
    head_blocks = triton.cdiv(num_heads, block_h)
    prefix_keys = keys == "all" and prefix_out is None
    num_splits = choose_mla_splits(num_tokens * head_blocks, max_seq_len, q_nope.device,
                                   block_n, waves) if prefix_keys else 1
    part_out = part_lse = None
    if num_splits > 1:
        part_out = torch.empty(num_splits, num_tokens, num_heads, rank, dtype=torch.float32,
                               device=q_nope.device)
        # Padding rows are never written: no keys (-inf) for the LSE over the splits.
        part_lse = torch.full((num_splits, num_tokens, num_heads), float("-inf"),
                              dtype=torch.float32, device=q_nope.device)
    grid = (num_tokens, head_blocks, num_splits)
    _mla_tree_kernel[grid](
        q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, token_req, mask,
        out, lse, part_out if part_out is not None else out,
        part_lse if part_lse is not None else lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table.stride(0),
        mask.stride(0) if tree_mask is not None else 0,
        mask.stride(1) if tree_mask is not None else 0,
        out.stride(0), out.stride(1), lse.stride(0),
        num_heads, num_reqs, scale,
        RANK=rank, RANK_PAD=dot_width(rank), ROPE=rope, ROPE_PAD=dot_width(rope),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n,
        HAS_MASK=tree_mask is not None, PREFIX_GIVEN=prefix_out is not None,
        PREFIX_KEYS=prefix_keys, SPLIT=num_splits > 1,
        DOT_PRECISION="tf32x3" if q_nope.dtype == torch.float32 else "tf32",
    )
    if num_splits > 1:
        merge_splits(out, part_out, part_lse, query_start_loc)
        # The LSE over every split, natural log; a row that saw no key: +inf.
        lse = torch.logsumexp(part_lse * LN2, dim=0).T.contiguous()
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return out, lse


def check_tiling(block_n: int, waves: int) -> None:
    """Keys per tile: a power of two that tl.dot takes (>= 16); programs per SM >= 1."""
    if block_n < 16 or block_n & (block_n - 1) or waves < 1:
        raise ValueError(f"block_n={block_n}, waves={waves}: expected block_n a power of "
                         "two >= 16 and waves >= 1")


def dot_width(n: int) -> int:
    """A tile width for ``n`` columns that ``tl.dot`` takes on a GPU: a power of two, at
    least 16 (the reduction size of its smallest MMA; the interpreter does not check)."""
    return max(16, triton.next_power_of_2(n))


LN2 = 0.6931471805599453


def choose_mla_splits(programs: int, max_seq_len: int | None, device: torch.device,
                      block_n: int = BLOCK_N, waves: int = WAVES) -> int:
    """KV splits per row: enough programs for ``waves`` per SM, none shorter than 16
    key tiles; 1 without a bound on the prefix."""
    if not max_seq_len:
        return 1
    wanted = triton.cdiv(waves * sm_count(device), max(1, programs))
    return max(1, min(wanted, max_seq_len // (16 * block_n), 64))


@triton.jit
def _mla_tree_kernel(
    q_nope_ptr, q_pe_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, token_req_ptr,
    mask_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    qn_stride_t, qn_stride_h, qp_stride_t, qp_stride_h,
    kv_stride_b, kv_stride_s, kv_stride_d,
    bt_stride_r, mask_stride_r, mask_stride_i,
    out_stride_t, out_stride_h, lse_stride_h,
    num_heads, num_reqs, scale,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, PREFIX_GIVEN: tl.constexpr, PREFIX_KEYS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    req = tl.load(token_req_ptr + t)
    real = req < num_reqs  # padding rows: no keys, nothing stored
    head_ok = (heads < num_heads) & ((heads * 0 + req) < num_reqs)
    req = tl.minimum(req, num_reqs - 1)
    first = tl.load(qsl_ptr + req)
    num_queries = tl.where(real, tl.load(qsl_ptr + req + 1) - first, 0)
    row = t - first
    # Never below 0: a capture's dummy lengths must not send key reads out of range.
    prefix_len = tl.maximum(tl.load(seq_lens_ptr + req) - num_queries, 0)

    offs_r = tl.arange(0, RANK_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    r_ok = offs_r < RANK
    p_ok = offs_p < ROPE
    qn = tl.load(q_nope_ptr + t * qn_stride_t + heads[:, None] * qn_stride_h + offs_r[None, :],
                 mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    qp = tl.load(q_pe_ptr + t * qp_stride_t + heads[:, None] * qp_stride_h + offs_p[None, :],
                 mask=head_ok[:, None] & p_ok[None, :], other=0.0)

    if PREFIX_GIVEN:
        lse0 = tl.load(lse_ptr + heads * lse_stride_h + t, mask=head_ok,
                       other=float("inf"))
        empty = lse0 == float("inf")
        m = tl.where(empty, float("-inf"), lse0)
        l_sum = tl.where(empty, 0.0, 1.0)
        acc = tl.load(out_ptr + t * out_stride_t + heads[:, None] * out_stride_h
                      + offs_r[None, :], mask=head_ok[:, None] & r_ok[None, :],
                      other=0.0).to(tl.float32)
        acc = tl.where(empty[:, None], 0.0, acc)
    else:
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, RANK_PAD), tl.float32)

    if PREFIX_KEYS:
        # This split's chunk of the prefix, whole key tiles each.
        chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * chunk, prefix_len)
        hi = tl.minimum(lo + chunk, prefix_len)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            m, l_sum, acc = _attend_keys(
                qn, qp, m, l_sum, acc, pos, pos < hi, pos < hi,
                kv_ptr, block_table_ptr + req * bt_stride_r, kv_stride_b, kv_stride_s,
                kv_stride_d, offs_r, offs_p, r_ok, p_ok, scale, RANK, PAGE_SIZE,
                DOT_PRECISION)

    # The tree keys go to the last split.
    tree_keys = tl.where(split == num_splits - 1, num_queries, 0)
    for start in range(0, tree_keys, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < num_queries
        if HAS_MASK:
            words = tl.load(mask_ptr + req * mask_stride_r + row * mask_stride_i + keys // 32,
                            mask=key_ok, other=0)
            seen = key_ok & (((words >> (keys % 32)) & 1) != 0)
        else:
            seen = key_ok & (keys <= row)
        m, l_sum, acc = _attend_keys(
            qn, qp, m, l_sum, acc, prefix_len + keys, key_ok, seen,
            kv_ptr, block_table_ptr + req * bt_stride_r, kv_stride_b, kv_stride_s,
            kv_stride_d, offs_r, offs_p, r_ok, p_ok, scale, RANK, PAGE_SIZE, DOT_PRECISION)

    none = l_sum == 0.0
    result = acc / tl.where(none, 1.0, l_sum)[:, None]
    lse = m + tl.log(tl.where(none, 1.0, l_sum))
    if SPLIT:  # partial results for merge_splits: [split, token, head(, rank)], log2 LSE
        part_row = (split * tl.num_programs(0) + t).to(tl.int64) * num_heads + heads
        tl.store(part_out_ptr + part_row[:, None] * RANK + offs_r[None, :], result,
                 mask=head_ok[:, None] & r_ok[None, :])
        tl.store(part_lse_ptr + part_row, tl.where(none, float("-inf"), lse * 1.4426950408889634),
                 mask=head_ok)
    else:
        tl.store(out_ptr + t * out_stride_t + heads[:, None] * out_stride_h
                 + offs_r[None, :], result.to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None] & r_ok[None, :])
        tl.store(lse_ptr + heads * lse_stride_h + t, tl.where(none, float("inf"), lse),
                 mask=head_ok)


@triton.jit
def _attend_keys(
    qn, qp, m, l_sum, acc, pos, key_ok, seen,
    kv_ptr, block_table_row, kv_stride_b, kv_stride_s, kv_stride_d,
    offs_r, offs_p, r_ok, p_ok, scale,
    RANK: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One tile of keys at positions ``pos`` (loaded where ``key_ok``, attended where
    ``seen``) folded into the online softmax ``(m, l_sum, acc)``."""
    block = tl.load(block_table_row + pos // PAGE_SIZE, mask=key_ok, other=0)
    base = kv_ptr + block.to(tl.int64) * kv_stride_b + (pos % PAGE_SIZE) * kv_stride_s
    kv_c = tl.load(base[:, None] + offs_r[None, :] * kv_stride_d,
                   mask=key_ok[:, None] & r_ok[None, :], other=0.0)
    k_pe = tl.load(base[:, None] + (RANK + offs_p[None, :]) * kv_stride_d,
                   mask=key_ok[:, None] & p_ok[None, :], other=0.0)
    s = tl.dot(qn, tl.trans(kv_c), input_precision=DOT_PRECISION)
    s = tl.dot(qp, tl.trans(k_pe), s, input_precision=DOT_PRECISION) * scale
    s = tl.where(seen[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)  # exp(-inf) = 0 while nothing was seen
    p = tl.exp(s - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(kv_c.dtype), kv_c, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_sum, acc
