"""Compaction's row moves and the verify step's positions, a launch each per step.

After the walk (ops/compaction.py), row ``row_start + d`` of the
hidden states, the auxiliary hidden states and the token ids takes row
``row_start + node_d``, and the positions of the sent nodes go back to chain
order. In torch that is a plan, a gather and a scatter per tensor and a
scatter-add for the positions, some forty small launches every step; here
tensors of one dtype and row layout move in one launch, and the positions in
another. (Before the verify step, the tree nodes' depth positions come from the
step-trees launch, step_trees.py; on CUDA the runner compacts in one launch,
compact_step.py, and these kernels serve the layouts that launch does not take.)

Torch twins: ``compaction.compact_rows`` and ``compaction.restore_chain_positions`` on
their torch paths (the CPU path and the test oracle).

Ordering: one program per (tensor, request) makes that request's moves in
depth order; the move into depth d reads row ``row_start + node_d`` with
``node_d >= d``, and later moves read deeper rows still, so no move reads a row
an earlier one wrote, as in the twin's gather-then-scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.device import require_triton_device
from vllm_ddtree.kernels.kv_move import element_offsets

__all__ = ["ROW_BLOCK", "compact_rows_triton", "move_request_rows",
           "restore_chain_positions_triton"]

ROW_BLOCK = 1024  # elements of a row moved per iteration


def compact_rows_triton(
    tensors: Sequence[torch.Tensor],  # each [num_rows, ...] with contiguous rows
    accepted_nodes: torch.Tensor,  # [num_reqs, max_depth + 1] int64, -1 past the path
    row_start: torch.Tensor,  # [num_reqs] int64
) -> None:
    """Row row_start + d of every tensor takes row row_start + node_d, in place.
    One launch per group of tensors alike in dtype, row length and row stride."""
    require_triton_device(accepted_nodes, "compact_rows_triton", "ops.compaction.compact_rows")
    num_reqs, width = accepted_nodes.shape
    if row_start.shape != (num_reqs,):
        raise ValueError(f"row_start must be [num_reqs] = [{num_reqs}], got {tuple(row_start.shape)}")
    if num_reqs == 0 or width < 2 or not tensors:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        rows = t.view(t.shape[0], -1)  # a view: rows must be contiguous (raises otherwise)
        key = (rows.dtype, rows.shape[1], rows.stride(0), rows.shape[0])
        groups.setdefault(key, []).append(rows)
    accepted = accepted_nodes.contiguous()
    start = row_start.contiguous()
    for (_, row, row_stride, num_rows), rows in groups.items():
        compact_rows_kernel[(len(rows), num_reqs)](
            rows[0],
            element_offsets(rows),
            accepted,
            start,
            num_rows,
            width,
            row_stride,
            ROW=row,
            BLOCK=min(triton.next_power_of_2(row), ROW_BLOCK),
        )


def restore_chain_positions_triton(
    positions: torch.Tensor,  # [num_rows] root + depth at node rows
    row_start: torch.Tensor,  # [num_reqs] int64
    num_scheduled: torch.Tensor,  # [num_reqs] int64
    width: int,  # > every num_scheduled
) -> None:
    """positions[row_start + i] = positions[row_start] + i for 0 < i <= num_scheduled."""
    require_triton_device(positions, "restore_chain_positions_triton",
                          "compaction.restore_chain_positions")
    num_reqs = row_start.shape[0]
    if num_scheduled.shape != (num_reqs,) or positions.dim() != 1:
        raise ValueError(
            f"positions must be [num_rows] and num_scheduled [num_reqs] = [{num_reqs}], got "
            f"{tuple(positions.shape)} and {tuple(num_scheduled.shape)}"
        )
    if num_reqs == 0:
        return
    chain_positions_kernel[(num_reqs,)](
        positions, row_start.contiguous(), num_scheduled.contiguous(),
        BLOCK=triton.next_power_of_2(max(width, 2)),
    )


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows", "width"])
def compact_rows_kernel(
    base_ptr,  # first tensor's rows
    offset_ptr,  # [num_tensors] int64, elements from the first tensor
    accepted_ptr,  # [num_reqs, width] int64
    row_start_ptr,  # [num_reqs] int64
    num_rows,
    width,
    row_stride,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tensor = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    move_request_rows(base_ptr + tl.load(offset_ptr + tensor), accepted_ptr + req * width,
                      tl.load(row_start_ptr + req), num_rows, width, row_stride, ROW, BLOCK)


@triton.jit
def move_request_rows(
    base,  # one tensor's rows
    path,  # [width] int64, the request's node accepted at each depth, -1 past the path
    start,  # int64, the request's root row
    num_rows,
    width,
    row_stride,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One request's row moves in one tensor, in depth order (module docstring); also
    called by compact_step_triton's one-launch kernel."""
    cols = tl.arange(0, BLOCK)
    for d in range(1, width):  # depth order: see the module docstring
        node = tl.load(path + d)
        if (node > d) & (start + node < num_rows):
            src = base + (start + node) * row_stride
            dst = base + (start + d) * row_stride
            for c in range(0, ROW, BLOCK):
                ok = c + cols < ROW
                tl.store(dst + c + cols, tl.load(src + c + cols, mask=ok), mask=ok)


@triton.jit
def chain_positions_kernel(
    positions_ptr,  # [num_rows]
    row_start_ptr,  # [num_reqs] int64
    num_scheduled_ptr,  # [num_reqs] int64
    BLOCK: tl.constexpr,  # >= width
):
    req = tl.program_id(0)
    start = tl.load(row_start_ptr + req)
    count = tl.load(num_scheduled_ptr + req)
    root = tl.load(positions_ptr + start)
    i = tl.arange(0, BLOCK)
    tl.store(positions_ptr + start + i, root + i, mask=(i >= 1) & (i <= count))
