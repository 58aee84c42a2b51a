"""DDTree verification walk in Triton: the whole walk down the tree in one launch.

Same signature and outputs as ``ops.walk.walk_tree`` (its torch twin, the CPU path and the
test oracle); ops/walk.py defines the walk and the output formats. The torch walk costs a
handful of small launches per depth, which dominates a host-launch-bound decode step; this
kernel loops over depth inside one program per request.

Kernel design (one program per request; BLOCK = next power of 2 >= budget + 1 lanes, one
per node): the request's tokens, parents, valid flags and target tokens are loaded once
into registers. Each depth reads the target token at the current node and looks for the
valid child (node >= 1) carrying it; siblings carry distinct tokens, so at most one lane
matches (the lowest is taken, as torch's argmax does). Once no child matches, the same
query fails at every later depth, so the walk stays put without a separate alive flag.
The accepted path and its tokens accumulate in registers and every output element is
stored once at the end (no host sync, so the launch can be captured in a CUDA graph).
The node count is a runtime argument (the sampler's width changes from step to step), so
only BLOCK and max_depth select a compiled variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.device import require_triton_device
from vllm_ddtree.tensors import (
    DDTree,
    WalkResult,
    check_counts_args,
    check_max_depth,
    check_walk_args,
    walk_buffers,
)

__all__ = ["walk_rows_triton", "walk_tree_triton"]


def walk_tree_triton(
    tree: DDTree,
    target_tokens: torch.Tensor,  # [num_reqs, budget + 1] int32 or int64; target token at every node
    max_depth: int,
) -> WalkResult:
    """Follow the target's tokens down the tree in one launch (Triton twin of ops.walk.walk_tree)."""
    _check_inputs(tree, target_tokens, max_depth)
    return _launch_walk(tree, _unit_columns(target_tokens), max_depth)


def walk_rows_triton(
    tree: DDTree,
    row_tokens: torch.Tensor,  # [num_rows] int32 or int64, the target's token at every logits row
    cu_num_sampled: torch.Tensor,  # [num_reqs] cumulative logits rows per request
    num_scheduled: torch.Tensor,  # [num_reqs] int64, drafts sent per request
    max_depth: int,
    num_sampled_out: torch.Tensor | None = None,  # [num_reqs] int32 (out): tokens committed
    *,
    num_rejected_out: torch.Tensor | None = None,  # [num_reqs] int32 (out), with num_sampled_out
    chunked_prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out: WalkResult | None = None,  # [>= num_reqs, ...] buffers to write the walk into
) -> WalkResult:
    """verify.walk_rows in one launch: the walk reads each node's target token from
    its logits row itself (no ``step_rows`` index, no gather); with
    ``num_rejected_out`` and ``chunked_prefill`` also what vLLM's
    ``get_num_sampled_and_rejected`` makes of the counts (verify.walk_rows says how)."""
    num_reqs = tree.tokens.shape[0]
    check_max_depth(max_depth)
    _check_tree(tree)
    if row_tokens.dim() != 1 or row_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_tokens must be 1-D int32 or int64, got {row_tokens.dtype} "
                         f"{tuple(row_tokens.shape)}")
    if cu_num_sampled.shape != (num_reqs,) or num_scheduled.shape != (num_reqs,):
        raise ValueError(
            f"cu_num_sampled and num_scheduled must be [num_reqs] = [{num_reqs}], got "
            f"{tuple(cu_num_sampled.shape)} and {tuple(num_scheduled.shape)}"
        )
    check_counts_args(num_reqs, num_sampled_out, num_rejected_out, chunked_prefill)
    return _launch_walk(tree, row_tokens, max_depth, rows=(cu_num_sampled, num_scheduled),
                        num_sampled_out=num_sampled_out, num_rejected_out=num_rejected_out,
                        chunked_prefill=chunked_prefill, out=out)


def _launch_walk(
    tree: DDTree,
    target: torch.Tensor,  # [num_reqs, n] with unit columns, or [num_rows] with rows
    max_depth: int,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cu_num_sampled, num_scheduled)
    num_sampled_out: torch.Tensor | None = None,
    num_rejected_out: torch.Tensor | None = None,
    chunked_prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out: WalkResult | None = None,
) -> WalkResult:
    num_reqs, n = tree.tokens.shape
    device = tree.tokens.device
    walk = walk_buffers(num_reqs, n, max_depth, device, out)
    accepted_nodes, num_accepted = walk.accepted_nodes, walk.num_accepted
    bonus_tokens, output_tokens = walk.bonus_tokens, walk.output_tokens
    if num_reqs > 0:
        # The sampler passes column slices of the stored trees ([:, :width]); row strides
        # read them in place instead of copying (a copy is a launch per tensor).
        tokens, parents = _unit_columns(tree.tokens), _unit_columns(tree.parents)
        valid = _unit_columns(tree.valid).view(torch.uint8)
        cu_rows, scheduled = rows if rows is not None else (num_accepted, num_accepted)
        # Pointers of absent inputs are never read (their flags are off): any tensor.
        seq_lens, idx_mapping, prefill_len = chunked_prefill or (num_accepted,) * 3
        block = triton.next_power_of_2(n)
        walk_tree_kernel[(num_reqs,)](
            accepted_nodes,
            num_accepted,
            bonus_tokens,
            output_tokens,
            num_sampled_out if num_sampled_out is not None else num_accepted,
            num_rejected_out if num_rejected_out is not None else num_accepted,
            seq_lens,
            idx_mapping,
            prefill_len,
            tokens,
            parents,
            valid,
            target,
            cu_rows,
            scheduled,
            n,
            tokens.stride(0),
            parents.stride(0),
            valid.stride(0),
            target.stride(0) if rows is None else 0,
            MAX_DEPTH=max_depth,
            BLOCK=block,
            PATH_BLOCK=triton.next_power_of_2(max_depth + 1),
            FROM_ROWS=rows is not None,
            NUM_SAMPLED=num_sampled_out is not None,
            NUM_REJECTED=num_rejected_out is not None,
            CHUNKED_PREFILL=chunked_prefill is not None,
            num_warps=1 if block <= 128 else (2 if block <= 256 else 4),
        )
    return walk


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    """t itself when its columns are adjacent (any row stride), else a contiguous copy."""
    return t if t.stride(1) == 1 else t.contiguous()


def _check_inputs(tree: DDTree, target_tokens: torch.Tensor, max_depth: int) -> None:
    check_walk_args(tree, target_tokens, max_depth)
    if target_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"target_tokens must be int32 or int64, got {target_tokens.dtype}")
    _check_tree(tree)


def _check_tree(tree: DDTree) -> None:
    for name in ("tokens", "parents"):
        dtype = getattr(tree, name).dtype
        if dtype != torch.int64:
            raise ValueError(f"tree.{name} must be int64, got {dtype}")
    if tree.valid.dtype != torch.bool or tree.valid.shape != tree.tokens.shape:
        raise ValueError(
            f"tree.valid must be bool {tuple(tree.tokens.shape)}, got "
            f"{tree.valid.dtype} {tuple(tree.valid.shape)}"
        )
    require_triton_device(tree.tokens, "walk_tree_triton", "ops.walk.walk_tree")


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n", "tokens_stride", "parents_stride", "valid_stride", "target_stride"],
            do_not_specialize_on_alignment=["cu_rows_ptr", "scheduled_ptr"])
def walk_tree_kernel(
    accepted_ptr,  # [num_reqs, MAX_DEPTH + 1] int64
    num_accepted_ptr,  # [num_reqs] int64
    bonus_ptr,  # [num_reqs] int64
    output_ptr,  # [num_reqs, n] int64
    num_sampled_ptr,  # [num_reqs] int32 (out, NUM_SAMPLED): accepted drafts + the bonus
    num_rejected_ptr,  # [num_reqs] int32 (out, NUM_REJECTED): logits rows - num_sampled
    seq_lens_ptr,  # [num_reqs] (CHUNKED_PREFILL) sequence length after the step
    idx_mapping_ptr,  # [num_reqs] (CHUNKED_PREFILL) request state index
    prefill_len_ptr,  # [num_states] (CHUNKED_PREFILL) prompt tokens to prefill
    tokens_ptr,  # [num_reqs, n] int64, row stride tokens_stride
    parents_ptr,  # [num_reqs, n] int64, row stride parents_stride
    valid_ptr,  # [num_reqs, n] uint8 (bool), row stride valid_stride
    target_ptr,  # [num_reqs, n] int32 or int64, row stride target_stride; FROM_ROWS: [num_rows]
    cu_rows_ptr,  # [num_reqs] cumulative logits rows (FROM_ROWS)
    scheduled_ptr,  # [num_reqs] int64, drafts sent (FROM_ROWS)
    n,  # budget + 1 nodes per request (the sampler's width varies per step), column 0 the root
    tokens_stride,
    parents_stride,
    valid_stride,
    target_stride,
    MAX_DEPTH: tl.constexpr,
    BLOCK: tl.constexpr,  # power of 2 >= n: one lane per node
    PATH_BLOCK: tl.constexpr,  # power of 2 >= MAX_DEPTH + 1: one lane per path depth
    FROM_ROWS: tl.constexpr,  # node i reads row end - scheduled - 1 + min(i, scheduled)
    NUM_SAMPLED: tl.constexpr,
    NUM_REJECTED: tl.constexpr,  # with NUM_SAMPLED and FROM_ROWS
    CHUNKED_PREFILL: tl.constexpr,  # a request still prefilling commits nothing
):
    req = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    row = lane < n
    tokens = tl.load(tokens_ptr + req * tokens_stride + lane, mask=row, other=0)
    parents = tl.load(parents_ptr + req * parents_stride + lane, mask=row, other=-1)
    if FROM_ROWS:  # absent nodes (i > scheduled) repeat the request's last row
        scheduled = tl.load(scheduled_ptr + req)
        first = tl.load(cu_rows_ptr + req).to(tl.int64) - scheduled - 1
        at = first + tl.minimum(lane, scheduled)
    else:
        at = req * target_stride + lane
    target = tl.load(target_ptr + at, mask=row, other=0).to(tl.int64)
    # Column 0 (the root) is its own parent; it is never anyone's child.
    valid = tl.load(valid_ptr + req * valid_stride + lane, mask=row & (lane >= 1), other=0)
    candidate = valid != 0

    depth_lane = tl.arange(0, PATH_BLOCK)
    path = tl.where(depth_lane == 0, 0, -1).to(tl.int64)  # node at each depth, -1 past k
    path_tokens = tl.full([BLOCK], -1, tl.int64)  # chain format: token of path node j + 1
    current = tl.full([], 0, tl.int32)
    k = tl.full([], 0, tl.int32)
    for d in range(MAX_DEPTH):
        want = tl.sum(tl.where(lane == current, target, 0))  # target token at the current node
        match = candidate & (parents == current) & (tokens == want)  # <= 1 lane
        child = tl.min(tl.where(match, lane, BLOCK))
        found = child < BLOCK
        child_token = tl.sum(tl.where(lane == child, tokens, 0))
        path = tl.where((depth_lane == d + 1) & found, child, path)
        path_tokens = tl.where((lane == d) & found, child_token, path_tokens)
        current = tl.where(found, child, current)
        k += found.to(tl.int32)

    bonus = tl.sum(tl.where(lane == current, target, 0))
    out = tl.where(lane < k, path_tokens, tl.where(lane == k, bonus, -1))
    tl.store(output_ptr + req * n + lane, out, mask=row)
    tl.store(accepted_ptr + req * (MAX_DEPTH + 1) + depth_lane, path, mask=depth_lane <= MAX_DEPTH)
    tl.store(num_accepted_ptr + req, k.to(tl.int64))
    tl.store(bonus_ptr + req, bonus)
    if NUM_SAMPLED:
        committed = k + 1
        if CHUNKED_PREFILL:
            state = tl.load(idx_mapping_ptr + req)
            prefilling = tl.load(seq_lens_ptr + req) < tl.load(prefill_len_ptr + state)
            committed = tl.where(prefilling, 0, committed)
        tl.store(num_sampled_ptr + req, committed)
        if NUM_REJECTED:  # one logits row per draft plus the bonus, none while prefilling
            rejected = (scheduled + 1 - committed).to(tl.int32)
            if CHUNKED_PREFILL:
                rejected = tl.where(prefilling, 0, rejected)
            tl.store(num_rejected_ptr + req, rejected)
