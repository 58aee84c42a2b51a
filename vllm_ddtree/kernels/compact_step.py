"""A verify step's whole compaction in one launch.

After the walk (ops/compaction.py), three things move so the accepted path looks
like a chain: the KV entries of every target layer (kv_move.py), the rows
the drafter reads (hidden and auxiliary hidden states, token ids: compact_rows.py),
and the verify rows' positions, back to chain order. Those were three launches, each
costing the host tens of microseconds at every step (``benchmarks/results/
gpu_profile_20261130_26519d0.json``: the compaction took 0.28 ms of host time per
batch-1 step). Here one launch does all three: program ``(p, r)`` works on request r
and, by p,

- ``p < num_layers``: KV moves of layer p (``move_request_kv``, as in
  ``compact_kv_kernel``);
- ``num_layers <= p < num_layers + num_row_tensors``: row moves of one state tensor
  (``move_request_rows``, as in ``compact_rows_kernel``; the tensors share a dtype, row
  length and row stride);
- the last program: token-id moves, then the positions (as ``chain_positions_kernel``).

The parts touch disjoint memory, so their order does not matter; within a part each
program keeps its twin's depth order (see the twins' docstrings for why no move reads a
value another move of the same request wrote). Torch twin: ``compaction.apply_kv_moves``
per layer, ``compaction.compact_rows`` and ``compaction.restore_chain_positions`` on their
torch paths; the kernels of those two modules are kept for layouts this launch does not
take (state tensors that differ in layout, caches that are not alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.compact_rows import ROW_BLOCK as MAX_ROW_BLOCK
from vllm_ddtree.kernels.compact_rows import move_request_rows
from vllm_ddtree.kernels.device import require_triton_device
from vllm_ddtree.kernels.kv_move import (
    RAW_DTYPES,
    element_offsets,
    move_request_kv,
    triton_can_move,
)

__all__ = ["compact_step_triton", "rows_alike"]


def rows_alike(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the state tensors fit one launch: 2-D, contiguous rows, one dtype,
    row length, row stride and row count."""
    first = tensors[0]
    return all(
        t.dim() == 2 and t.stride(1) == 1 and t.dtype == first.dtype
        and t.shape == first.shape and t.stride(0) == first.stride(0)
        and t.device == first.device
        for t in tensors
    )


def compact_step_triton(
    kv_caches: Sequence[torch.Tensor] | None,  # per layer [num_blocks, heads, page, 2 * head]
    slot_mapping: torch.Tensor | None,  # [num_tokens] flat slot per verify row, -1 = padding
    states: Sequence[torch.Tensor],  # each [num_rows, hidden]: hidden and aux hidden states
    token_ids: torch.Tensor,  # [>= num_rows] the drafter's input ids
    positions: torch.Tensor,  # [>= num_rows] root + depth at node rows
    accepted_nodes: torch.Tensor,  # [num_reqs, max_depth + 1] int64, -1 past the path
    row_start: torch.Tensor,  # [num_reqs] int64, flat row of each root
    num_scheduled: torch.Tensor,  # [num_reqs] int64, tree nodes sent per request
    width: int,  # > every num_scheduled: the step's verify width
) -> None:
    """In place, for each request: the KV entries, state rows and token ids of the node
    accepted at depth d move to row ``row_start + d``; positions go back to chain order."""
    require_triton_device(accepted_nodes, "compact_step_triton", "the ops/compaction.py twins")
    num_reqs, path_width = accepted_nodes.shape
    if row_start.shape != (num_reqs,) or num_scheduled.shape != (num_reqs,):
        raise ValueError(
            f"row_start and num_scheduled must be [num_reqs] = [{num_reqs}], got "
            f"{tuple(row_start.shape)} and {tuple(num_scheduled.shape)}"
        )
    if not states or not rows_alike(states):
        raise ValueError("the state tensors must be 2-D and alike in dtype, shape and strides")
    if token_ids.dim() != 1 or positions.dim() != 1:
        raise ValueError("token_ids and positions must be 1-D")
    has_kv = bool(kv_caches)
    if has_kv and (slot_mapping is None or not triton_can_move(kv_caches)):
        raise ValueError(
            "compact_step_triton needs a slot mapping and CUDA caches of one shape, stride "
            "and 1/2/4-byte dtype with contiguous rows"
        )
    if num_reqs == 0:
        return
    if has_kv:
        first = kv_caches[0]
        _, heads, page, kv_row = first.shape
        cache = first.view(RAW_DTYPES[first.element_size()])
        layer_offsets = element_offsets(kv_caches)
        kv_strides = first.stride()[:3]
        num_tokens = slot_mapping.shape[0]
    else:  # unused pointers (HAS_KV is False): any tensors of the right kinds
        heads = page = kv_row = 1
        cache, layer_offsets, slot_mapping = positions, positions, positions
        kv_strides, num_tokens = (0, 0, 0), 0
    num_layers = len(kv_caches) if has_kv else 0
    row = states[0].shape[1]
    compact_step_kernel[(num_layers + len(states) + 1, num_reqs)](
        cache, layer_offsets, slot_mapping, num_tokens, *kv_strides,
        states[0], element_offsets(states), states[0].shape[0], states[0].stride(0),
        token_ids, token_ids.shape[0],
        positions, num_scheduled.contiguous(),
        accepted_nodes.contiguous(), row_start.contiguous(), path_width, num_layers, len(states),
        HAS_KV=has_kv,
        PAGE_SIZE=page,
        NUM_KV_HEADS=heads,
        HEADS_PAD=triton.next_power_of_2(heads),
        KV_ROW=kv_row,
        KV_ROW_PAD=triton.next_power_of_2(kv_row),
        ROW=row,
        ROW_BLOCK=min(triton.next_power_of_2(row), MAX_ROW_BLOCK),
        POS_BLOCK=triton.next_power_of_2(max(width, 2)),
    )


# ----------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens", "num_rows", "num_ids", "path_width",
                               "num_layers", "num_states"])
def compact_step_kernel(
    cache_ptr,  # first layer's cache as raw ints (HAS_KV)
    layer_offset_ptr,  # [num_layers] int64, elements from the first layer's cache
    slot_ptr,  # [num_tokens] flat slot of each verify row, -1 = padding
    num_tokens,
    stride_block,
    stride_head,
    stride_slot,
    state_ptr,  # first state tensor's rows
    state_offset_ptr,  # [num_states] int64, elements from the first state tensor
    num_rows,
    row_stride,
    ids_ptr,  # [num_ids] token ids
    num_ids,
    positions_ptr,  # [>= num_rows] positions
    num_scheduled_ptr,  # [num_reqs] int64
    accepted_ptr,  # [num_reqs, path_width] int64, -1 past the path
    row_start_ptr,  # [num_reqs] int64
    path_width,
    num_layers,
    num_states,
    HAS_KV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_ROW: tl.constexpr,  # 2 * head_size: K then V
    KV_ROW_PAD: tl.constexpr,
    ROW: tl.constexpr,  # state row length
    ROW_BLOCK: tl.constexpr,
    POS_BLOCK: tl.constexpr,  # >= the verify width
):
    part = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    start = tl.load(row_start_ptr + req)
    path = accepted_ptr + req * path_width
    if part < num_layers:
        if HAS_KV:  # num_layers is 0 otherwise; this drops the code
            move_request_kv(cache_ptr + tl.load(layer_offset_ptr + part), slot_ptr, path, start,
                            num_tokens, path_width, stride_block, stride_head, stride_slot,
                            PAGE_SIZE, NUM_KV_HEADS, HEADS_PAD, KV_ROW, KV_ROW_PAD)
    elif part < num_layers + num_states:
        move_request_rows(state_ptr + tl.load(state_offset_ptr + (part - num_layers)), path,
                          start, num_rows, path_width, row_stride, ROW, ROW_BLOCK)
    else:
        for d in range(1, path_width):
            node = tl.load(path + d)
            if (node > d) & (start + node < num_ids):
                tl.store(ids_ptr + start + d, tl.load(ids_ptr + start + node))
        count = tl.load(num_scheduled_ptr + req)
        root = tl.load(positions_ptr + start)
        i = tl.arange(0, POS_BLOCK)
        tl.store(positions_ptr + start + i, root + i, mask=(i >= 1) & (i <= count))
