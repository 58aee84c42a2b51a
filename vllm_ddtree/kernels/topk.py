"""Deterministic top-k per depth on CUDA: a two-launch top-k for small k, and for
larger k the tie repair of torch.topk in one Triton launch. Both have the same torch
twin, ``tree.topk_per_depth(..., use_triton=False)``.

``topk_triton`` (``tree.topk_per_depth`` takes it for k <= ``FUSED_TOPK_MAX_K``) reads
each row once: one program per
(row, block of ``_TOPK_BLOCK`` entries) packs every entry into an int64 key that orders
by (clamped value, lower id first), takes the block's k largest keys, and one program
per row takes the k largest of its blocks' candidates. Keys are unique, so the result
is the rule below with no tie left to repair; at batch 32 a Qwen3 drafter's 480 rows
of 151936 float32 log-probabilities are read once (about 0.3 GB), where torch.topk's
radix selection passes over them several times. Its cost grows with k (k rounds of a
block-wide max): on the H200 at k = 16 it took 0.38x torch.topk + repair's time at
batch 1 and 0.79x at batch 32 (benchmarks/results/tree_ops_topk_h200.json), hence the dispatch bound.

``tree.topk_per_depth`` calls it on CUDA; its torch twin, ``tree._repair_ties``, is
the CPU path and the test oracle. The rule: the top-k of the clamped log-probabilities,
ordered by (value descending, token id ascending), ties at the k-th value keeping the
lowest ids.

torch.topk may keep any of the tokens tied at the k-th value. The torch path repairs
that with a pass over the whole vocabulary of every row (compare, cumulative sum,
search: about a gigabyte of traffic per step at batch 32 for a 151936-token
vocabulary). Here one torch.topk takes k + 1 values: a row needs repair only when the
(k + 1)-th clamped value equals the k-th, since otherwise every token of that value is
already among the k. Rows that need none return at once; the others scan the
vocabulary for the lowest ids of that value in two launches over (row, vocabulary
block) programs: the first counts each block's tied tokens, the second sums the
counts of the blocks before its own and, if fewer than the ids needed came before,
writes its tied ids at their ranks. (One program per row scanning the vocabulary
alone took 0.09 ms of a batch-1 H200 step when a drafter's bf16 logits tie, as a
flat distribution's do: ``benchmarks/results/gpu_profile.json``.) The top-k itself
and the ordering inside runs of equal values stay in tree.topk_per_depth, shared by
both paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.device import require_triton_device

__all__ = ["FUSED_TOPK_MAX_K", "repair_ties_triton", "topk_triton"]

_VOCAB_BLOCK = 4096  # vocabulary entries per program (tie repair)
_TOPK_BLOCK = 2048  # vocabulary entries per program (fused top-k, first launch)
FUSED_TOPK_MAX_K = 16  # tree.topk_per_depth's bound: measured faster up to here
_TOPK_MAX_UNROLL = 64  # topk_triton's own bound (its k rounds are unrolled)
_KEY_NONE = tl.constexpr(-(2**63))  # below every entry's key: a taken or out-of-range slot


def topk_triton(
    logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab] float32, no NaN
    k: int,
    floor: float,  # clamp bounds [floor, 0], as tree.LOGPROB_FLOOR
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, max_depth, k] float32 / int64
    """Top-k of the clamped log-probabilities per row, ordered by (value descending, id
    ascending), ties at the k-th value keeping the lowest ids: tree.topk_per_depth's
    result, in two launches and one read of the rows. Capturable in a CUDA graph."""
    require_triton_device(logprobs, "topk_triton", "tree.topk_per_depth")
    num_reqs, max_depth, vocab = logprobs.shape
    if not 1 <= k <= min(vocab, _TOPK_MAX_UNROLL):
        raise ValueError(f"topk_triton takes 1 <= k <= min(vocab={vocab}, "
                         f"{_TOPK_MAX_UNROLL}), got k={k}")
    rows = logprobs.contiguous()
    num_rows = num_reqs * max_depth
    vals = torch.empty(num_reqs, max_depth, k, dtype=torch.float32, device=rows.device)
    ids = torch.empty(num_reqs, max_depth, k, dtype=torch.int64, device=rows.device)
    if num_rows == 0:
        return vals, ids
    block = min(triton.next_power_of_2(vocab), _TOPK_BLOCK)
    num_blocks = triton.cdiv(vocab, block)
    keys = torch.empty(num_rows, num_blocks, k, dtype=torch.int64, device=rows.device)
    block_topk_kernel[(num_rows, num_blocks)](rows, keys, vocab, num_blocks, floor,
                                              K=k, BLOCK=block, num_warps=4)
    candidates = triton.next_power_of_2(num_blocks * k)
    merge_topk_kernel[(num_rows,)](keys, vals, ids, num_blocks, K=k,
                                   CANDIDATES=candidates,
                                   num_warps=8 if candidates >= 2048 else 4)
    return vals, ids


def repair_ties_triton(
    logprobs: torch.Tensor,  # [num_reqs, max_depth, vocab] float32, no NaN
    vals: torch.Tensor,  # [num_reqs, max_depth, k + 1] clamped top values, descending
    ids: torch.Tensor,  # [num_reqs, max_depth, k + 1] their ids from torch.topk (rewritten)
    run_start: torch.Tensor,  # [num_reqs, max_depth, k] first slot of each slot's value
    floor: float,  # clamp bounds [floor, 0], as tree.LOGPROB_FLOOR
) -> None:
    """In place: where the (k + 1)-th value ties the k-th, the slots tied at the k-th
    value take the lowest tied ids, ascending (tree._repair_ties' Triton twin). With
    k = vocab (no (k + 1)-th value) every id is already there: nothing to do."""
    require_triton_device(logprobs, "repair_ties_triton", "tree.topk_per_depth")
    num_reqs, max_depth, vocab = logprobs.shape
    k = run_start.shape[-1]
    if vals.shape[-1] != k + 1 or num_reqs * max_depth == 0:
        return
    if not (vals.is_contiguous() and ids.is_contiguous() and run_start.is_contiguous()):
        raise ValueError("vals, ids and run_start must be contiguous")
    rows = logprobs.contiguous()
    block = min(triton.next_power_of_2(vocab), _VOCAB_BLOCK)
    num_blocks = triton.cdiv(vocab, block)
    grid = (num_reqs * max_depth, num_blocks)
    counts = torch.empty(num_reqs * max_depth, num_blocks, dtype=torch.int32,
                         device=logprobs.device)
    args = (rows, vals, counts, vocab, floor)
    count_ties_kernel[grid](*args, num_blocks, K=k, TAKEN=k + 1, BLOCK=block)
    repair_ties_kernel[grid](*args, num_blocks, ids, run_start, K=k, TAKEN=k + 1,
                             BLOCK=block, BLOCKS_PAD=triton.next_power_of_2(num_blocks))


@triton.jit(do_not_specialize=["vocab", "floor", "num_blocks"])
def count_ties_kernel(
    rows_ptr,  # [num_rows, vocab] float32 log-probabilities
    vals_ptr,  # [num_rows, TAKEN] float32 clamped top values, descending
    counts_ptr,  # [num_rows, num_blocks] int32 (out): tokens of the k-th value per block
    vocab,
    floor,
    num_blocks,
    K: tl.constexpr,
    TAKEN: tl.constexpr,  # K + 1
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    kth = tl.load(vals_ptr + row * TAKEN + K - 1)
    if tl.load(vals_ptr + row * TAKEN + K) == kth:  # a tie crosses the k-th slot
        at = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(rows_ptr + row * vocab + at, mask=at < vocab, other=0.0)
        hit = (tl.minimum(tl.maximum(x, floor), 0.0) == kth) & (at < vocab)
        tl.store(counts_ptr + row * num_blocks + block, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["vocab", "floor", "num_blocks"])
def repair_ties_kernel(
    rows_ptr,  # [num_rows, vocab] float32 log-probabilities
    vals_ptr,  # [num_rows, TAKEN] float32 clamped top values, descending
    counts_ptr,  # [num_rows, num_blocks] int32 from count_ties_kernel (rows with a tie)
    vocab,
    floor,
    num_blocks,
    ids_ptr,  # [num_rows, TAKEN] int64 their ids (rewritten where ties cross slot K - 1)
    run_start_ptr,  # [num_rows, K] int64 first slot of each slot's value
    K: tl.constexpr,
    TAKEN: tl.constexpr,  # K + 1
    BLOCK: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,  # power of 2 >= num_blocks
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    kth = tl.load(vals_ptr + row * TAKEN + K - 1)
    if tl.load(vals_ptr + row * TAKEN + K) == kth:  # a tie crosses the k-th slot
        first = tl.load(run_start_ptr + row * K + K - 1)  # slots first .. K-1 hold kth
        need = K - first  # that many lowest ids of value kth, ascending
        earlier = tl.arange(0, BLOCKS_PAD)
        before = tl.sum(tl.load(counts_ptr + row * num_blocks + earlier,
                                mask=earlier < block, other=0), axis=0).to(tl.int64)
        if before < need:
            at = block * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(rows_ptr + row * vocab + at, mask=at < vocab, other=0.0)
            hit = (tl.minimum(tl.maximum(x, floor), 0.0) == kth) & (at < vocab)
            rank = before + tl.cumsum(hit.to(tl.int32), axis=0).to(tl.int64) - 1
            tl.store(ids_ptr + row * TAKEN + first + rank, at.to(tl.int64),
                     mask=hit & (rank < need))


@triton.jit(do_not_specialize=["vocab", "num_blocks", "floor"])
def block_topk_kernel(
    rows_ptr,  # [num_rows, vocab] float32 log-probabilities
    keys_ptr,  # [num_rows, num_blocks, K] int64 (out): the block's K largest keys
    vocab,
    num_blocks,
    floor,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    at = block * BLOCK + tl.arange(0, BLOCK)
    ok = at < vocab
    x = tl.load(rows_ptr + row * vocab + at, mask=ok, other=0.0)
    c = tl.minimum(tl.maximum(x, floor), 0.0)
    c = tl.where(c == 0.0, 0.0, c)  # -0.0 ties +0.0, as == says
    # Float bits -> int32 of the same order (negatives: flip the magnitude bits), then
    # the high word of the key; the low word (2^31 - 1 - id) puts lower ids first.
    bits = c.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - at).to(tl.int64)
    key = tl.where(ok, key, _KEY_NONE)
    out = keys_ptr + (row * num_blocks + block) * K
    for i in tl.static_range(K):
        best = tl.max(key, axis=0)
        tl.store(out + i, best)
        key = tl.where(key == best, _KEY_NONE, key)  # keys are unique: one slot goes


@triton.jit(do_not_specialize=["num_blocks"])
def merge_topk_kernel(
    keys_ptr,  # [num_rows, num_blocks, K] int64 from block_topk_kernel
    vals_ptr,  # [num_rows, K] float32 (out): clamped values, descending
    ids_ptr,  # [num_rows, K] int64 (out): their ids, ascending inside equal values
    num_blocks,
    K: tl.constexpr,
    CANDIDATES: tl.constexpr,  # power of 2 >= num_blocks * K
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CANDIDATES)
    n = num_blocks * K
    key = tl.load(keys_ptr + row * n + offs, mask=offs < n, other=_KEY_NONE)
    for i in tl.static_range(K):
        best = tl.max(key, axis=0)
        ordered = (best >> 32).to(tl.int32)
        bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
        tl.store(vals_ptr + row * K + i, bits.to(tl.float32, bitcast=True))
        tl.store(ids_ptr + row * K + i, 0x7FFFFFFF - (best & 0x7FFFFFFF))
        key = tl.where(key == best, _KEY_NONE, key)
